#!/usr/bin/env python
"""Samples/s and real tokens/s of the real job: MindSpeed-MM's ``pretrain_vlm.py`` as is against
the same command line plus ``--use-flowtrain``, at PP=1 and PP=2, rounds interleaved in one run.

A benchmark, not a test (numbers depend on the machine and its load).  It runs the real-job
harness (``tests/upstream/realjob.py``: unmodified ``pretrain_vlm.py`` under torchrun, tiny
Qwen2.5-VL, its "huggingface" data path, gloo on CPU) in the upstream environment::

    .venv-upstream/bin/python scripts/bench_mindspeed_mm.py [--iters 12] [--rounds 2] [--pp 1 2]

Per run: the step time is the sum of Megatron's logged "elapsed time per iteration" over the
iterations after ``--warmup``; samples = consumed samples over those iterations (as logged; the
plugin logs the samples its packs completed); real tokens = the tokens of those samples that
reached the model (tags read back from ``input_ids``; padding excluded).  Each round runs
upstream then the plugin for every PP size; the ratio is plugin / upstream of the summed rates.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "upstream"))
sys.path.insert(0, str(ROOT / "tests" / "support"))

from realjob import RealJob, run_real_job  # noqa: E402
from realjob_run import RealRun  # noqa: E402


def measure(run: RealRun, warmup: int) -> dict:
    logged = run.logged
    timed = [i for i in sorted(logged) if i > warmup]
    seconds = sum(float(logged[i]["elapsed time per iteration (ms)"]) for i in timed) / 1000.0
    samples = run.consumed[timed[-1]] - run.consumed[timed[0] - 1]
    tokens = run.real_tokens_per_iteration()
    return {"iterations": len(timed), "seconds": seconds, "samples": samples,
            "real_tokens": sum(tokens.get(i, 0) for i in timed), "wall_s": run.wall_s}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="first iterations left out of the timing")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--gbs", type=int, default=8)
    parser.add_argument("--samples", type=int, default=160, help="corpus size")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per run")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="write the numbers here")
    args = parser.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_mindspeed_mm_"))
    variants = {"upstream": (), "flowtrain": ("--use-flowtrain",)}
    results: dict = {f"pp{pp}/{v}": [] for pp in args.pp for v in variants}
    started = time.monotonic()
    for round_ in range(args.rounds):
        for pp in args.pp:
            for variant, flags in variants.items():
                job = RealJob(pp=pp, iters=args.iters, gbs=args.gbs, samples=args.samples, plugin=flags,
                              timeout_s=args.timeout)
                name = f"r{round_}_pp{pp}_{variant}"
                run = run_real_job(job, root / name, check=False, assets=root / f"assets_{args.samples}")
                if run.returncode != 0:
                    print(f"[bench] {name}: FAILED rc {run.returncode}\n{run.output[-3000:]}", flush=True)
                    results[f"pp{pp}/{variant}"].append({"failed": run.returncode})
                    continue
                m = measure(run, args.warmup)
                results[f"pp{pp}/{variant}"].append(m)
                print(f"[bench] {name}: {m['samples'] / m['seconds']:.2f} samples/s, "
                      f"{m['real_tokens'] / m['seconds']:.0f} real tokens/s "
                      f"({m['samples']} samples, {m['real_tokens']} tokens in {m['seconds']:.1f} s; "
                      f"run {m['wall_s']:.0f} s)", flush=True)
    print(f"\n[bench] {args.rounds} rounds, {args.iters} iterations per run ({args.warmup} warm-up), "
          f"gbs {args.gbs}, seq-length 256, {time.monotonic() - started:.0f} s in all")
    print("| PP | job | samples/s | real tokens/s | ratio samples/s | ratio tokens/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    summary = {}
    for pp in args.pp:
        rates = {}
        for variant in variants:
            ok = [m for m in results[f"pp{pp}/{variant}"] if "failed" not in m]
            if not ok:
                rates[variant] = None
                continue
            seconds = sum(m["seconds"] for m in ok)
            rates[variant] = (sum(m["samples"] for m in ok) / seconds, sum(m["real_tokens"] for m in ok) / seconds)
        for variant in variants:
            rate = rates[variant]
            if rate is None:
                print(f"| {pp} | {variant} | failed | failed | | |")
                continue
            ratio = ""
            if variant != "upstream" and rates["upstream"]:
                ratio = f"x{rate[0] / rates['upstream'][0]:.2f} | x{rate[1] / rates['upstream'][1]:.2f}"
            else:
                ratio = " | "
            print(f"| {pp} | {variant} | {rate[0]:.2f} | {rate[1]:.0f} | {ratio} |")
        summary[f"pp{pp}"] = rates
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "rates": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
