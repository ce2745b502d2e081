"""Benchmark: compose (and validate, simulate) on large pipelines, against the scan merge.

Until issue 13, compose merged the skeletons' orders by scanning every rank before every
pick (``tests/support/schedule_merge_reference.py``, O(p^2 m)).  This script composes the same
plans with the heap merge of ``order.merge`` and, as the named baseline, with that scan
swapped in, in the same run, checks that both give identical programs, and prints the times
and their ratio.  validate and simulate are timed per action for scale.  Every measurement
runs in a fresh process (a large earlier plan leaves the allocator's arenas fragmented),
and times are that process's CPU seconds (``time.process_time``): the machine may be shared,
and wall time would count other processes' turns.

    python scripts/bench_schedule_compose.py                # 16x64, 32x128, 64x512
    python scripts/bench_schedule_compose.py --sizes 64x512 --no-baseline
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from unittest import mock

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "support"))

from schedule_merge_reference import scan_merge  # noqa: E402

from mindspeed_flow.schedule import (  # noqa: E402
    CostTable,
    Interleaved1F1B,
    OneFOneB,
    Region,
    RegionCost,
    compose,
    simulate,
    validate,
)

COMPOSE_MODULE = sys.modules["mindspeed_flow.schedule.compose"]
SKELETONS = {"1f1b": OneFOneB, "interleaved": Interleaved1F1B}


def timed(fn, *args, **kwargs):
    start = time.process_time()
    result = fn(*args, **kwargs)
    return result, time.process_time() - start


def measure(name: str, stages: int, microbatches: int, scan: bool) -> tuple[float, str, int, float, float]:
    """In a fresh process: compose one plan (with the scan merge if ``scan``) and, for the
    heap merge, validate and simulate it; CPU seconds, a digest of the programs, actions."""
    regions = [Region("llm", 2 * stages, SKELETONS[name](stages=stages))]
    if scan:
        with mock.patch.object(COMPOSE_MODULE, "merge", scan_merge):
            plan, seconds = timed(compose, regions, microbatches)
    else:
        plan, seconds = timed(compose, regions, microbatches)
    digest = hashlib.sha256(plan.format().encode()).hexdigest()
    actions = sum(len(p) for p in plan.programs.values())
    check = replay = 0.0
    if not scan:
        _, check = timed(validate, plan)
        _, replay = timed(simulate, plan, CostTable({"llm": RegionCost(forward=1.0)}))
    return seconds, digest, actions, check, replay


def fresh(*args) -> tuple[float, str, int, float, float]:
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, *args).result()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="16x64,32x128,64x512", help="STAGESxMICROBATCHES, comma separated")
    parser.add_argument("--no-baseline", action="store_true", help="skip the scan merge (slow at 64x512)")
    args = parser.parse_args()
    sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")]
    cases = [(name, p, m) for p, m in sizes for name in SKELETONS]
    rows = []
    for name, stages, microbatches in tqdm(cases, desc="plans", unit="plan", file=sys.stderr):
        heap, digest, actions, check, replay = fresh(name, stages, microbatches, False)
        scan = None
        if not args.no_baseline:
            scan, baseline, _, _, _ = fresh(name, stages, microbatches, True)
            if baseline != digest:
                raise SystemExit(f"{name} {stages}x{microbatches}: the heap merge changed the programs")
        rows.append((name, stages, microbatches, actions, heap, scan, check, replay))
    header = (f"{'skeleton':<12} {'stages':>6} {'mbs':>5} {'actions':>8} {'compose s':>10} "
              f"{'scan s':>8} {'speedup':>8} {'validate us/a':>14} {'simulate us/a':>14}")
    print("CPU seconds, each in a fresh process; scan: compose with the pre-issue-13 merge "
          "(the baseline), same plans, programs checked identical")
    print(header)
    print("-" * len(header))
    for name, stages, microbatches, actions, heap, scan, check, replay in rows:
        baseline = f"{scan:>8.2f} {scan / heap:>7.1f}x" if scan is not None else f"{'-':>8} {'-':>8}"
        print(f"{name:<12} {stages:>6} {microbatches:>5} {actions:>8} {heap:>10.2f} {baseline} "
              f"{check / actions * 1e6:>14.1f} {replay / actions * 1e6:>14.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
