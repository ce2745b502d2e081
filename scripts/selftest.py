"""The self-test (``mindspeed-flow selftest``): each capability checked on its own, for real, on
this machine.  Sections (``--only NAME``, repeatable; ``--list``):

doctor: every declared patch against the installed upstream (megatron-core).
megatron-pp2: megatron-core's own 1F1B schedule, PP=2 over two gloo processes, against
   a single-process reference of the same tiny GPT (losses, every gradient, call order).
packing: a seeded infographic-VQA stream packed online at 8K tokens, then each step's
   packs dispatched by cost over 8 DP ranks x 8 microbatches, against round-robin.
attention: fused varlen attention, a packed batch through megatron-core's GPTModel with the
   fused_attn patch enabled, against the same samples run one by one.
schedules: Megatron-style (best split), DistTrain-like, Mpipe <transpose, 1f1b> in its
   orders (ready / the public code's prefix, owner / recompute backward), <transpose, zb-h1>
   and FlowTrain decoupled, simulated at 72B / 512-device scale, with one Gantt chart each.
   The table's step times are means over the config's simulated steps (seeds); each chart
   draws the first of them (seed 0) and its title gives both.

Nothing here is canned: every number printed is computed in this run.  Charts go to
``outputs/selftest/`` (``--out``).  Every check is the package's (the tiny GPT of
:mod:`mindspeed_flow.adapters.megatron.tiny_gpt` on the ranks of :mod:`mindspeed_flow.spawn`,
:mod:`mindspeed_flow.train.packed_gpt_check`); nothing of ``tests/`` is imported.  The workload and
simulation configs are the checkout's (``configs/``), so this script runs from a source checkout.
The main job, which trains a model with every feature on against the baseline, is
``mindspeed-flow train`` (``scripts/demo.sh``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]


def section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 76 - len(title)), flush=True)


def check_doctor() -> None:
    from mindspeed_flow.doctor import check_installed_patches
    from mindspeed_flow.patches import all_patches
    from mindspeed_flow.patching.status import format_table

    rows = check_installed_patches(all_patches())
    print(format_table(rows))
    failing = [r for r in rows if r.is_failure]
    print(f"{len(rows)} patches, {len(failing)} required target(s) missing or changed")


def check_megatron_pp2() -> None:
    from mindspeed_flow.adapters.megatron import tiny_gpt as harness

    spec = harness.TinyGPTSpec()
    reference = harness.run_reference(spec)
    stages = harness.run_pipelined(spec, reference.state_dict, harness.ONE_F_ONE_B, pipeline_parallel_size=2)
    merged = harness.merge_stage_results(stages)
    ref = reference.result
    worst = max((merged.grads[n] - g).abs().max().item() for n, g in ref.grads.items())
    print(f"tiny GPT: {spec.num_layers} layers, hidden {spec.hidden_size}, {spec.num_microbatches} microbatches")
    print("losses  reference:", " ".join(f"{x:.6f}" for x in ref.losses))
    print("losses  PP=2 1F1B:", " ".join(f"{x:.6f}" for x in merged.losses))
    print(f"gradients: {len(ref.grads)} tensors, max |PP=2 - reference| = {worst:.3g}")
    for stage in stages:
        order = " ".join(f"{e.kind}{e.microbatch}" for e in stage.events)
        print(f"rank {stage.rank} order: {order}")


def check_packing() -> None:
    import yaml

    from mindspeed_flow.packing import BestFitPacker, CostModel, dispatch
    from mindspeed_flow.packing.workloads import generate

    spec = yaml.safe_load((ROOT / "configs/workloads/infographic_vqa.yaml").read_text())
    lengths = generate(spec, 100_000, seed=0).lengths
    capacity, dp, microbatches = 8192, 8, 8
    packer = BestFitPacker(capacity, window=1024, overlong="truncate")
    packs = []
    for i, length in enumerate(tqdm(lengths.tolist(), desc="online packing", mininterval=1.0, leave=False)):
        packs += packer.add(i, length)
    packs += packer.flush()
    stats = packer.stats
    print(f"{stats.items:,} infographic-VQA samples, online best-fit (window 1024) at {capacity} tokens: "
          f"{stats.packs:,} packs, lower bound {-(-stats.tokens // capacity):,}, "
          f"fill {stats.tokens / (stats.packs * capacity):.2%}; {stats.truncated:,} overlong samples truncated")
    # LLM-side cost of a pack under varlen attention, FLOPs of a 7B-like decoder (28 layers,
    # hidden 3584): linear in tokens plus quadratic per segment.
    model = CostModel(linear=6 * 7.6e9, quadratic=6 * 28 * 3584)
    clipped = np.minimum(lengths, capacity)
    costs = np.array([model.cost(clipped[p]) for p in packs])
    per_step = dp * microbatches
    worst = {"dispatch": 0.0, "round-robin": 0.0}
    for step in range(len(costs) // per_step):
        c = costs[step * per_step:(step + 1) * per_step]
        for name, ranks in (("dispatch", dispatch(c, dp, pp_size=4)),
                            ("round-robin", [list(range(d, per_step, dp)) for d in range(dp)])):
            loads = np.array([c[r].sum() for r in ranks])
            worst[name] = max(worst[name], loads.max() / loads.mean())
    print(f"{len(costs) // per_step} steps of {dp} DP ranks x {microbatches} microbatches, worst max/mean rank cost: "
          f"dispatch {worst['dispatch']:.4f}, round-robin {worst['round-robin']:.4f}")


def check_fused_attention() -> None:
    # The same fresh-interpreter run as tests/adapters/megatron/test_attention.py: the fused_attn
    # patch must be enabled before megatron is imported.
    import json
    import os
    import subprocess

    environ = {k: v for k, v in os.environ.items() if k != "MINDSPEED_FLOW_FLAGS"}
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.train.packed_gpt_check"], capture_output=True,
                          text=True, timeout=300, env=environ)
    if proc.returncode != 0:
        raise RuntimeError(f"mindspeed_flow.train.packed_gpt_check failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print("megatron-core GPTModel (RoPE, GQA), fused_attn enabled, one THD pack of samples "
          "of 5, 1, 17 and 9 tokens against each sample alone:")
    print(f"  logits {out['shape']}: max |packed - alone| = {out['logits']:.3g}")
    print(f"  parameter gradients: max relative difference = {out['grads_rel']:.3g}")


def check_schedules(charts: Path) -> None:
    from mindspeed_flow.schedule.scenarios import format_table, load, run

    config = load(ROOT / "configs/sim/vlm_72b_e2e.yaml")
    rows = run(config, charts)
    print(format_table(config.get("name", "vlm_72b_e2e"), rows))
    print(f"Gantt charts: {charts}/ (seed 0 of {config.get('seeds', 1)}: one sampled step, not the mean above)")


def sections(out: Path) -> dict[str, tuple[str, Callable[[], None]]]:
    """Section name -> (title, check), in running order."""
    return {
        "doctor": ("doctor: patch targets in the installed upstream", check_doctor),
        "megatron-pp2": ("megatron-core 1F1B, PP=2 over gloo, against a single process", check_megatron_pp2),
        "packing": ("packing and cost-balanced dispatch", check_packing),
        "attention": ("fused varlen attention inside megatron-core", check_fused_attention),
        "schedules": ("schedules at 72B / 512 devices", lambda: check_schedules(out / "sim")),
    }


def main() -> int:
    from mindspeed_flow.selftest import add_selftest_arguments

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    args = add_selftest_arguments(parser).parse_args()
    table = sections(args.out or ROOT / "outputs" / "selftest")
    if args.list:
        for name, (title, _) in table.items():
            print(f"{name:<14} {title}")
        return 0
    unknown = [name for name in args.only if name not in table]
    if unknown:
        parser.error(f"--only {', '.join(unknown)}: no such section (sections: {', '.join(table)})")
    chosen = [(name, *table[name]) for name in table if not args.only or name in args.only]
    torch.manual_seed(0)
    for number, (name, title, check) in enumerate(tqdm(chosen, desc="selftest", unit="section",
                                                       file=sys.stderr), start=1):
        section(f"{number}. {title} [{name}]")
        start = time.perf_counter()
        check()
        print(f"[{time.perf_counter() - start:.1f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
