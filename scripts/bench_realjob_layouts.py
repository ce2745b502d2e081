#!/usr/bin/env python
"""Step time of MindSpeed-MM's real job under its layouts, in one run: upstream's co-located
1F1B against FlowTrain's decoupled layout and the transposed ViT, with the schedule simulator's
prediction beside each.

A benchmark, not a test (numbers depend on the machine and its load).  Every run is the
real-job harness (``tests/upstream/realjob.py``: unmodified ``pretrain_vlm.py`` under
torchrun, the tiny Qwen2.5-VL, its data path, gloo on CPU), global batch 4, micro batch 1,
the LLM at PP=2 (one layer per stage)::

    .venv-upstream/bin/python scripts/bench_realjob_layouts.py [--iters 10] [--modes real emulated]

Layouts:

- ``upstream``: ``pretrain_vlm.py`` as is at PP=2, Megatron's 1F1B, the ViT in stage 0: the
  named baseline;
- ``colocated``: the same with ``--use-flowtrain`` (packing loader, varlen attention, the
  runtime's 1F1B, the ViT still in stage 0): the same packs as the two below, so the step
  ratio against it is the layout's own effect;
- ``decoupled``: ``--use-flowtrain --flow-schedule-config tests/upstream/decoupled_layout.yaml``
  on 3 ranks (the ViT on a rank of its own, the LLM's 2 stages, the ``shm`` pool);
- ``flow``: ``--use-flowtrain --flow-schedule-config tests/upstream/flow_layout.yaml``: the
  decoupled row's 3 ranks with FlowTrain's flow instead of the lockstep plan (the encoder rank
  encodes the step's samples in batches of at most 64 ViT patches and puts one pool entry per
  sample; the LLM's first stage takes its packs' samples by key); the ratio against
  ``decoupled`` is the flow's own effect.  No simulator prediction (the flow's plan,
  ``compose_flow``, needs the step's grouping, which the job builds inside);
- ``transposed``: ``--use-flowtrain --flow-schedule-config tests/upstream/transpose_layout.yaml``
  at PP=2 (a ViT replica on each stage, ``<transpose, 1f1b>``);
- ``hetero-parallel``: MindSpeed-MM's own ``--hetero-parallel`` as a baseline, upstream as is
  (``tests/upstream/test_real_job_hetero.HETERO``): its three-phase co-located step, the image
  encoder data parallel over both ranks, the LLM's 1F1B at PP=2.  On the pinned code it runs
  only with a frozen image encoder (no encoder backward phase) and 2 samples per micro-batch
  (``--global-batch-size 8``, which upstream rescales to 4 samples per step, as the other
  rows'); the simulator has no prediction for it here (docs/schedule.md has the three-phase
  simulator row).  A row whose logged global batch differs from upstream's gets no step
  ratio (samples/s compares).

Modes:

- ``real``: CPU compute only.  Every rank shares this machine's cores (``nproc``), so the
  decoupled layout's third rank competes with the other two for them: this mode says what a
  CPU run costs, not what separate devices would;
- ``emulated``: device compute emulated (the harness's ``REALJOB_EMULATE``): each training
  forward of the ViT sleeps ``--vit-s`` seconds, of an LLM stage ``--llm-s`` per layer, their
  backward twice that, next to the (small) real math.  Sleeping ranks do not share cores, as
  separate devices do not: this mode shows the schedules' overlap.

Per run: the step time is the median of Megatron's logged "elapsed time per iteration" after
``--warmup`` iterations; samples/s divides the consumed samples (as logged) by the summed
step times.  The simulator replays the layout's plan (Megatron's 1F1B with the ViT in stage 0;
the decoupled slice's ``<Decoupled, 1F1B>``; ``<transpose, 1f1b>``) with costs measured in
that run: the mean wall time of the ViT's and of an LLM stage's training forwards (the
harness's ``REALJOB_MODULE_TIMES``), backward twice the forward (not measured: an assumption),
no link costs.  Prints a table and writes a PNG (measured and simulated step per layout and
mode) and the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UPSTREAM_TESTS = ROOT / "tests" / "upstream"
sys.path.insert(0, str(UPSTREAM_TESTS))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from realjob import RealJob, run_real_job  # noqa: E402
from realjob_run import RealRun  # noqa: E402
from test_real_job_hetero import HETERO  # noqa: E402

from mindspeed_flow.decoupled.plan import slice_plan  # noqa: E402
from mindspeed_flow.runtime.layout import load_decoupled, plan_for, vlm_layout  # noqa: E402
from mindspeed_flow.schedule import CostTable, OneFOneB, Region, RegionCost, simulate  # noqa: E402
from mindspeed_flow.schedule.regions import BACKBONE_REGION, ENCODER_REGION  # noqa: E402

STAGES = 2
VIT_LAYERS = 2  # the tiny model's (tests/upstream/tiny_qwen2_5vl.json)
BACKWARD_RATIO = 2.0
DECOUPLED_FILE = UPSTREAM_TESTS / "decoupled_layout.yaml"
FLOW_FILE = UPSTREAM_TESTS / "flow_layout.yaml"
TRANSPOSE_FILE = UPSTREAM_TESTS / "transpose_layout.yaml"
FLOW = ("--use-flowtrain",)
LAYOUTS = {
    "upstream": RealJob(pp=STAGES),
    "colocated": RealJob(pp=STAGES, plugin=FLOW),
    "decoupled": RealJob(pp=STAGES, world_size=STAGES + 1,
                         plugin=FLOW + ("--flow-schedule-config", str(DECOUPLED_FILE))),
    "flow": RealJob(pp=STAGES, world_size=STAGES + 1, plugin=FLOW + ("--flow-schedule-config", str(FLOW_FILE))),
    "transposed": RealJob(pp=STAGES, plugin=FLOW + ("--flow-schedule-config", str(TRANSPOSE_FILE))),
    "hetero-parallel": HETERO,
}
# What a row runs that the others do not (printed under the table, kept in results.json).
NOTES = {
    "hetero-parallel": "MindSpeed-MM --hetero-parallel (three-phase co-located: ViT data parallel over both ranks, "
                       "LLM 1F1B at PP=2), upstream as is; the pinned code runs it only with a FROZEN image encoder "
                       "(no encoder backward) and 2 samples per micro-batch (the others: 1); --global-batch-size 8, "
                       "which upstream rescales to the others' 4 samples per step (logged); no simulator prediction",
    "flow": "FlowTrain's flow (tests/upstream/flow_layout.yaml) on the decoupled row's 3 ranks: one pool entry per "
            "sample, encoder batches of at most 64 patches; in this job the ViT encodes within the step (no running "
            "ahead) and the LLM's packs stay the loader's; no simulator prediction (compose_flow needs the step's "
            "grouping, built inside the job)",
}
SIMULATED = ("upstream", "colocated", "decoupled", "transposed")


def colocated_regions() -> list[Region]:
    """MindSpeed-MM's placement for the simulator: the ViT and the LLM cut together by one
    1F1B, the whole ViT in stage 0 beside the LLM's first layer."""
    skeleton = OneFOneB(stages=STAGES, layers=(2,) + (1,) * (STAGES - 1))
    return [Region(ENCODER_REGION, 1, skeleton), Region(BACKBONE_REGION, STAGES, skeleton)]


def layout_plan(name: str, microbatches: int):
    """The plan the simulator replays for a layout."""
    if name == "decoupled":
        return slice_plan(load_decoupled(DECOUPLED_FILE), microbatches)
    if name == "transposed":
        return plan_for(vlm_layout([VIT_LAYERS] + [0] * (STAGES - 1), [1] * STAGES, transpose=True), microbatches)
    return plan_for(colocated_regions(), microbatches)


def module_forward_s(run: RealRun, warmup: int) -> dict[str, float]:
    """Mean training-forward wall time of the ViT and of one LLM stage after the warm-up."""
    times: dict[str, list[float]] = {"vit": [], "llm": []}
    for record in run.records:
        if record["kind"] == "module_time" and (record.get("iteration") or 0) >= warmup:
            times[record["module"]].append(record["forward_s"])
    return {module: statistics.mean(values) for module, values in times.items() if values}


def predicted_step(name: str, forward: dict[str, float], microbatches: int):
    """The simulator's step for the layout, with the run's measured forward times."""
    costs = CostTable({ENCODER_REGION: RegionCost(forward=forward["vit"], backward_ratio=BACKWARD_RATIO),
                       BACKBONE_REGION: RegionCost(forward=forward["llm"] * STAGES, backward_ratio=BACKWARD_RATIO)})
    return simulate(layout_plan(name, microbatches), costs)


def measure(run: RealRun, warmup: int) -> dict:
    logged = run.logged
    timed = [i for i in sorted(logged) if i > warmup]
    steps = [float(logged[i]["elapsed time per iteration (ms)"]) / 1000.0 for i in timed]
    samples = run.consumed[timed[-1]] - run.consumed[timed[0] - 1]
    # upstream rescales some runs' global batch (--hetero-parallel: by world / (tp*pp*cp) / dp): the logged one
    batch = int(logged[timed[-1]].get("global batch size", samples / len(timed)))
    return {"step_s": statistics.median(steps), "samples_per_s": samples / sum(steps), "wall_s": run.wall_s,
            "global_batch": batch}


def row_job(name: str, iters: int, env: tuple, timeout_s: int) -> RealJob:
    """The real job a row runs: its layout's ``RealJob`` (``hetero-parallel``:
    ``test_real_job_hetero.HETERO`` as is) with this bench's iterations, environment and timeout."""
    return replace(LAYOUTS[name], iters=iters, env=env, timeout_s=timeout_s)


def table_line(mode: str, name: str, r: dict, base: dict | None, same_packs: dict | None) -> str:
    """One row of the table: step-time ratios only against a row with the same logged global
    batch (else nan: upstream rescales the hetero-parallel row's), samples/s against upstream,
    the simulator's step where the layout has one."""
    sim = r.get("sim_step_s")
    same_batch = base is not None and r["global_batch"] == base["global_batch"]
    return (f"{mode:<9}{name:<16}{r['step_s']:>8.3f}"
            f"{base['step_s'] / r['step_s'] if same_batch else float('nan'):>12.2f}x"
            f"{same_packs['step_s'] / r['step_s'] if same_packs and same_batch else float('nan'):>13.2f}x"
            f"{r['samples_per_s']:>11.2f}"
            f"{r['samples_per_s'] / base['samples_per_s'] if base else float('nan'):>12.2f}x"
            f"{sim if sim else float('nan'):>12.3f}{sim / r['step_s'] if sim else float('nan'):>14.2f}")


def flow_vs_decoupled(rows: dict) -> float | None:
    """The flow's speed-up over the lockstep decoupled step on the same ranks (the decoupled
    row's step time over the flow row's), or None without both rows or with different
    logged global batches."""
    flow, decoupled = rows.get("flow"), rows.get("decoupled")
    if not flow or not decoupled or flow["global_batch"] != decoupled["global_batch"]:
        return None
    return decoupled["step_s"] / flow["step_s"]


def draw(results: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(results)
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        names = list(results[mode])
        measured = [results[mode][n]["step_s"] for n in names]
        simulated = [results[mode][n].get("sim_step_s") or 0.0 for n in names]
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], measured, 0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], simulated, 0.4, label="simulated")
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("step time (s)")
        ax.set_title(f"{mode} compute")
        ax.legend()
    fig.suptitle("pretrain_vlm.py, tiny Qwen2.5-VL, LLM PP=2: step time per layout")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3, help="first iterations left out of the timing")
    parser.add_argument("--modes", nargs="+", default=["real", "emulated"], choices=["real", "emulated"])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--vit-s", type=float, default=0.4, help="emulated ViT forward, seconds per microbatch")
    parser.add_argument("--llm-s", type=float, default=0.2, help="emulated LLM forward, seconds per layer")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_realjob_layouts")
    args = parser.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_realjob_layouts_"))
    args.out.mkdir(parents=True, exist_ok=True)
    microbatches = RealJob().gbs  # micro batch 1, one LLM replica: a microbatch per sample (or pack)
    results: dict = {mode: {} for mode in args.modes}
    started = time.monotonic()
    total = len(args.modes) * len(args.layouts)
    for mode in args.modes:
        env = (("REALJOB_MODULE_TIMES", "1"),)
        if mode == "emulated":
            env += (("REALJOB_EMULATE", f"{args.vit_s}:{args.llm_s}"),)
        for name in args.layouts:
            job = row_job(name, args.iters, env, args.timeout)
            run = run_real_job(job, root / mode / name, check=False)
            done = sum(len(r) for r in results.values()) + 1
            print(f"[{done}/{total} {time.monotonic() - started:.0f} s] {mode} {name}: rc {run.returncode}, "
                  f"{run.wall_s:.0f} s", flush=True)
            if run.returncode != 0:
                raise SystemExit(f"{mode} {name} failed; its output is in {root / mode / name}\n{run.output[-3000:]}")
            numbers = measure(run, args.warmup)
            forward = module_forward_s(run, args.warmup)
            numbers["forward_s"] = forward
            numbers.update(micro_batch=job.mbs, **({"note": NOTES[name]} if name in NOTES else {}))
            if name in SIMULATED and {"vit", "llm"} <= set(forward):
                sim = predicted_step(name, forward, microbatches)
                numbers.update(sim_step_s=sim.step_time, sim_bubble=sim.bubble_fraction)
            results[mode][name] = numbers
    print(f"\npretrain_vlm.py, tiny Qwen2.5-VL, LLM PP={STAGES}, global batch {microbatches}, micro batch 1, "
          f"{args.iters} iterations (median step after {args.warmup}); emulated: ViT {args.vit_s} s per forward, "
          f"LLM {args.llm_s} s per layer, backward x2")
    header = (f"{'mode':<9}{'layout':<16}{'step s':>8}{'vs upstream':>13}{'vs colocated':>14}{'samples/s':>11}"
              f"{'vs upstream':>13}{'sim step s':>12}{'sim/measured':>14}")
    print(header)
    for mode, rows in results.items():
        base, same_packs = rows.get("upstream"), rows.get("colocated")
        for name, r in rows.items():
            print(table_line(mode, name, r, base, same_packs))
        speedup = flow_vs_decoupled(rows)
        if speedup is not None:
            rows["flow"]["speedup_vs_decoupled"] = speedup
            print(f"{mode}: flow vs decoupled (lockstep) on the same 3 ranks: {speedup:.2f}x")
    print("(x: speed-up, the baseline's step time over this layout's, nan where the global batch differs; "
          "samples/s: consumed samples over step time)")
    for name, note in NOTES.items():
        if any(name in rows for rows in results.values()):
            print(f"{name}: {note}")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    png = draw(results, args.out / "step_times.png")
    print(f"numbers: {args.out / 'results.json'}; chart: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
