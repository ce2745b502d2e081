"""The CPU demo: every capability that exists today, run for real on this machine.

1. doctor: every declared patch against the installed upstream (megatron-core).
2. Megatron on CPU: megatron-core's own 1F1B schedule, PP=2 over two gloo processes, against
   a single-process reference of the same tiny GPT (losses, every gradient, call order).
3. Packing: a seeded infographic-VQA workload packed at 8K tokens, then dispatched by cost
   over 8 DP ranks x 8 microbatches, against round-robin.
4. Fused varlen attention: a packed batch through megatron-core's GPTModel with the
   fused_attn patch enabled, against the same samples run one by one.
5. Schedules: Megatron-style, DistTrain-like, Mpipe <transpose, 1f1b> and FlowTrain
   decoupled, simulated at 72B / 512-device scale, with one Gantt chart each.

Nothing here is canned: every number printed is computed in this run.  Charts go to
``outputs/demo/``.  Megatron's tiny-GPT harness lives with the tests (``tests/``), which is
where its regression tests use it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def section(title: str) -> None:
    print(f"\n=== {title} " + "=" * max(0, 76 - len(title)), flush=True)


def demo_doctor() -> None:
    from mindspeed_flow.doctor import check_installed_patches
    from mindspeed_flow.patches import all_patches
    from mindspeed_flow.patching.status import format_table

    rows = check_installed_patches(all_patches())
    print(format_table(rows))
    failing = [r for r in rows if r.is_failure]
    print(f"{len(rows)} patches, {len(failing)} required target(s) missing or changed")


def demo_megatron_pp2() -> None:
    import megatron_cpu_harness as harness

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


def demo_packing() -> None:
    import yaml

    from mindspeed_flow.packing import CostModel, dispatch, pack
    from mindspeed_flow.packing.workloads import generate

    spec = yaml.safe_load((ROOT / "configs/workloads/infographic_vqa.yaml").read_text())
    workload = generate(spec, 200_000, seed=0)
    capacity = 8192
    start = time.perf_counter()
    packs = pack(workload.lengths, capacity, overlong="split")
    seconds = time.perf_counter() - start
    stats = packs.stats
    bound = -(-stats.tokens // capacity)
    print(f"{len(workload.lengths):,} samples, {stats.tokens:,} tokens -> {stats.packs:,} packs "
          f"(lower bound {bound:,}), fill {stats.tokens / (stats.packs * capacity):.4%}, {seconds:.2f} s")
    print(f"overlong samples split: {stats.split:,} into {stats.split_chunks:,} chunks")
    model = CostModel(linear=1.0, quadratic=1.0 / 4096, constant=0.0)
    chunk_lengths = np.asarray(workload.lengths, dtype=np.int64)
    # segment lengths per pack, with split samples cut at the capacity
    costs = [model.cost([min(int(chunk_lengths[i]), capacity) for i in p]) for p in packs[:64]]
    ranks = dispatch(costs, dp_size=8, pp_size=4)
    loads = np.array([sum(costs[i] for i in r) for r in ranks])
    robin = np.array([sum(costs[i] for i in range(k, 64, 8)) for k in range(8)])
    print(f"dispatch of 64 packs over 8 DP ranks: max/mean rank cost {loads.max() / loads.mean():.3f} "
          f"(round-robin {robin.max() / robin.mean():.3f})")


def demo_fused_attention() -> None:
    # The same fresh-interpreter run as tests/test_attention_megatron.py: the fused_attn
    # patch must be enabled before megatron is imported.
    from subprocess_utils import last_json, run_python
    from test_attention_megatron import GPT_SCRIPT

    out = last_json(run_python(GPT_SCRIPT))
    print("megatron-core GPTModel (RoPE, GQA), fused_attn enabled, one THD pack of samples "
          "of 5, 1, 17 and 9 tokens against each sample alone:")
    print(f"  logits {out['shape']}: max |packed - alone| = {out['logits']:.3g}")
    print(f"  parameter gradients: max relative difference = {out['grads_rel']:.3g}")


def demo_schedules(charts: Path) -> None:
    from mindspeed_flow.schedule.scenarios import format_table, load, run

    config = load(ROOT / "configs/sim/vlm_72b_e2e.yaml")
    rows = run(config, charts)
    print(format_table(config.get("name", "vlm_72b_e2e"), rows))
    print(f"Gantt charts: {charts}/")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "demo", help="folder for the charts")
    args = parser.parse_args()
    torch.manual_seed(0)
    steps = [
        ("1. doctor: patch targets in the installed upstream", demo_doctor),
        ("2. megatron-core 1F1B, PP=2 over gloo, against a single process", demo_megatron_pp2),
        ("3. packing and cost-balanced dispatch", demo_packing),
        ("4. fused varlen attention inside megatron-core", demo_fused_attention),
        ("5. schedules at 72B / 512 devices", lambda: demo_schedules(args.out / "sim")),
    ]
    for title, step in tqdm(steps, desc="demo", unit="step", file=sys.stderr):
        section(title)
        start = time.perf_counter()
        step()
        print(f"[{time.perf_counter() - start:.1f} s]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
