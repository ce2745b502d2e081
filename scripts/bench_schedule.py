"""Benchmark: the runtime on a tiny VLM with a heavy, jittery ViT, CPU, 4 gloo processes.

In one run, interleaved step by step, three configurations do the same work:

- **megatron**: megatron-core's real ``forward_backward_pipelining_without_interleaving``
  with the ViT inside pipeline stage 0 (MindSpeed-MM's placement): the named baseline;
- **ours-1f1b**: the same layout through our runtime (the patched
  ``get_forward_backward_func`` path, ``flow_forward_backward``): its step time over the
  baseline's is the runtime's overhead (target: within 5%);
- **ours-transpose**: ``<transpose, 1f1b>``: every rank holds a ViT replica and runs it
  for its own microbatches in the pipeline's bubbles.

Step time is the slowest rank's wall time from a barrier; the measured bubble fraction is
1 - (compute time of all ranks) / (ranks x step time).  ``simulate`` then replays both
layouts with costs calibrated from our runtime's per-action timestamps (per-microbatch ViT
times included): how far is the simulator from the measured step?  The measured timelines
are drawn with the simulator's Gantt code.

Four ranks share this machine's few cores, so device compute is emulated: each ViT and LLM
stage sleeps for its (seeded, jittery) device time in forward and backward, next to the
real GPTModel math.  Schedules then overlap work as separate devices would.

    python scripts/bench_schedule.py                     # 8 microbatches, 3 measured steps
    python scripts/bench_schedule.py --steps 5 --png-dir /tmp/gantt
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from typing import Callable  # noqa: E402

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from megatron_cpu_harness import launch  # noqa: E402
from tiny_vlm import StageModule, forward_step, gpt_stage, microbatch_index, vit as tiny_vit, vlm_items  # noqa: E402
from mindspeed_flow.runtime import measured_result  # noqa: E402
from mindspeed_flow.runtime.layout import plan_for  # noqa: E402
from mindspeed_flow.schedule import CostTable, Jitter, OneFOneB, Region, RegionCost, Transpose, simulate  # noqa: E402
from mindspeed_flow.schedule.gantt import draw  # noqa: E402

STAGES = 4
PATCHES, TEXT = 8, 8  # per microbatch: image tokens, text tokens
VIT = Jitter(low=0.030, high=0.090, spike_prob=0.15, spike=0.200, seed=3)  # forward seconds
LLM_FORWARD = 0.012  # per stage
BACKWARD_RATIO = 2.0
CONFIGS = ("megatron", "ours-1f1b", "ours-transpose")


class DeviceTime(torch.autograd.Function):
    """Identity that sleeps for a device's forward and backward time, and logs the span."""

    @staticmethod
    def forward(ctx, x, forward_s, backward_s, log):
        ctx.backward_s, ctx.log = backward_s, log
        _busy(forward_s, log)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _busy(ctx.backward_s, ctx.log)
        return grad, None, None, None


def _busy(seconds: float, log: list) -> None:
    start = time.monotonic()
    time.sleep(seconds)
    log.append(time.monotonic() - start)


def device_time(log: list, role: str) -> Callable:
    """A forward hook emulating the device compute of one of the tiny VLM's modules: the
    ViT's seeded jittery time per microbatch, a fixed time per LLM stage; backward
    ``BACKWARD_RATIO`` times."""

    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        seconds = VIT.sample(microbatch_index(args[0])) if role == "vit" else LLM_FORWARD
        return DeviceTime.apply(output, seconds, BACKWARD_RATIO * seconds, log)

    return hook


def transpose_regions() -> list[Region]:
    return [Region("vit", 1, Transpose()), Region("llm", STAGES, OneFOneB(stages=STAGES))]


def _worker(rank: int, world_size: int, microbatches: int, steps: int) -> dict:
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import schedules
    from megatron_cpu_harness import megatron_parallel

    from mindspeed_flow.adapters.megatron import schedule as adapter
    from mindspeed_flow.runtime import Binding, Executor

    out = {c: {"step": [], "busy": [], "timeline": None} for c in CONFIGS}
    with megatron_parallel(world_size):
        gpt = gpt_stage([1] * world_size, rank)
        log: list = []
        vit = tiny_vit()
        vit.register_forward_hook(device_time(log, "vit"))
        text = StageModule(gpt)
        with_vit = StageModule(gpt, vit=vit if rank == 0 else None)
        for stage in (text, with_vit):
            stage.register_forward_hook(device_time(log, "llm"))
        plan = plan_for(transpose_regions(), microbatches)
        executor = Executor(rank, list(range(world_size)))
        batches = vlm_items([PATCHES] * microbatches, TEXT, seed=5)
        common = dict(num_microbatches=microbatches, seq_length=PATCHES + TEXT, micro_batch_size=1)

        def run(config: str):
            data = iter(batches)
            if config == "megatron":
                schedules.forward_backward_pipelining_without_interleaving(
                    forward_step_func=forward_step, data_iterator=data, model=with_vit, **common)
                return None
            if config == "ours-1f1b":
                adapter.flow_forward_backward(forward_step_func=forward_step, data_iterator=data, model=with_vit, **common)
                return adapter.SETTINGS.last_timeline
            bindings = {("vit", 0): Binding(vit, data), ("llm", rank): Binding(text, data)}
            return executor.run(plan, forward_step, bindings).timeline

        for step in tqdm(range(steps + 1), desc=f"r{rank} steps", disable=rank != 0, file=sys.stderr):
            for config in CONFIGS:
                for module in (vit, gpt):
                    module.zero_grad(set_to_none=True)
                log.clear()
                dist.barrier()
                start = time.monotonic()
                timeline = run(config)
                elapsed = time.monotonic() - start
                if step:  # the first step warms up
                    out[config]["step"].append(elapsed)
                    out[config]["busy"].append(sum(log))
                    out[config]["timeline"] = timeline
    return out


def _calibrated_costs(plan, timelines) -> CostTable:
    """Region costs from measured per-action times: per-microbatch ViT forwards (as a
    scale), mean LLM stage forward (times the stages: costs are per whole region)."""
    vit_forward, llm_forward, backward = {}, [], {"vit": [], "llm": []}
    for t in timelines:
        for s in t.stamps:
            a, took = s.action, s.end - s.start
            if a.kind.value == "F" and a.region == "vit":
                vit_forward[a.microbatch] = took
            elif a.kind.value == "F":
                llm_forward.append(took)
            elif a.kind.value == "B":
                backward[a.region].append(took)
    vit_mean = statistics.mean(vit_forward.values())
    llm_mean = statistics.mean(llm_forward)
    regions = {
        "vit": RegionCost(forward=vit_mean, backward_ratio=statistics.mean(backward["vit"]) / vit_mean),
        "llm": RegionCost(forward=llm_mean * STAGES, backward_ratio=statistics.mean(backward["llm"]) / llm_mean),
    }
    scale = {m: f / vit_mean for m, f in vit_forward.items()}
    return CostTable(regions, microbatch_scale=lambda region, m: scale[m] if region == "vit" else 1.0)


def _megatron_layout_regions() -> list[Region]:
    """Megatron's placement for the simulator: ViT and LLM cut together, the ViT in stage 0."""
    skeleton = OneFOneB(stages=STAGES, layers=(2,) + (1,) * (STAGES - 1))
    return [Region("vit", 1, skeleton), Region("llm", STAGES, skeleton)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per configuration (after one warm-up)")
    parser.add_argument("--png-dir", type=Path, default=ROOT / "outputs" / "runtime")
    args = parser.parse_args()
    ranks = launch(_worker, STAGES, args.microbatches, args.steps, timeout_s=900)

    def step(config):  # the slowest rank, median over steps
        return statistics.median(max(r[config]["step"][i] for r in ranks) for i in range(args.steps))

    def bubble(config):
        fractions = []
        for i in range(args.steps):
            slowest = max(r[config]["step"][i] for r in ranks)
            fractions.append(1 - sum(r[config]["busy"][i] for r in ranks) / (STAGES * slowest))
        return statistics.median(fractions)

    measured = {c: (step(c), bubble(c)) for c in CONFIGS}
    plan_t = plan_for(transpose_regions(), args.microbatches)
    timelines_t = [r["ours-transpose"]["timeline"] for r in ranks]
    costs = _calibrated_costs(plan_t, timelines_t)
    predicted = {"ours-transpose": simulate(plan_t, costs),
                 "megatron": simulate(plan_for(_megatron_layout_regions(), args.microbatches), costs)}
    plan_1f1b = plan_for([Region("model", STAGES, OneFOneB(stages=STAGES))], args.microbatches)
    args.png_dir.mkdir(parents=True, exist_ok=True)
    pngs = [draw(measured_result(plan_t, timelines_t), args.png_dir / "runtime_measured_transpose.png",
                 "measured <transpose, 1f1b>"),
            draw(measured_result(plan_1f1b, [r["ours-1f1b"]["timeline"] for r in ranks]),
                 args.png_dir / "runtime_measured_1f1b.png", "measured 1F1B, ViT in stage 0 (our runtime)")]

    base = measured["megatron"][0]
    print(f"tiny VLM, PP={STAGES}, {args.microbatches} microbatches, ViT forward {VIT.low * 1e3:.0f}-"
          f"{VIT.high * 1e3:.0f} ms (spike {VIT.spike * 1e3:.0f} ms at p={VIT.spike_prob}), LLM stage "
          f"forward {LLM_FORWARD * 1e3:.0f} ms, backward x{BACKWARD_RATIO:g}; median of {args.steps} steps")
    print(f"{'config':<16}{'step s':>9}{'vs megatron':>13}{'bubble':>9}{'sim step s':>12}{'sim bubble':>12}")
    for c in CONFIGS:
        s, b = measured[c]
        sim = predicted.get(c)
        sim_text = f"{sim.step_time:>12.3f}{sim.bubble_fraction:>12.1%}" if sim else f"{'':>12}{'':>12}"
        print(f"{c:<16}{s:>9.3f}{s / base:>13.3f}{b:>9.1%}{sim_text}")
    print(f"speed-up of <transpose, 1f1b> over Megatron's schedule: {base / measured['ours-transpose'][0]:.2f}x "
          f"(simulator predicted {predicted['megatron'].step_time / predicted['ours-transpose'].step_time:.2f}x)")
    print(f"runtime overhead on identical 1F1B work: {measured['ours-1f1b'][0] / base - 1:+.1%} of Megatron's step")
    for c in ("megatron", "ours-transpose"):
        print(f"simulator vs measured, {c}: step {predicted[c].step_time / measured[c][0] - 1:+.1%}, "
              f"bubble {predicted[c].bubble_fraction - measured[c][1]:+.1%} points")
    print("gantt:", ", ".join(str(p) for p in pngs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
