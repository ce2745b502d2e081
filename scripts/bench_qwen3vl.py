#!/usr/bin/env python
"""Throughput of MindSpeed-MM's Qwen3-VL path (``pretrain_transformers.py CONFIG.yaml``) with and
without packing, in one run: upstream unpacked, upstream's own dynamic batching at each buffer
size asked for (its best one is the named baseline), and the plugin's packing (``--use-flowtrain``).

A benchmark, not a test (numbers depend on the machine and its load).  Every run is the real-job
harness (``tests/upstream/realjob_transformers.py``: the pinned, unmodified entry script under
torchrun, the recipe's YAML with a CPU run's changes, the tiny random Qwen3-VL, the
``"huggingface"`` conversation data path, gloo, one rank, Megatron DDP), global batch 4 of
micro batch 1::

    .venv-upstream/bin/python scripts/bench_qwen3vl.py [--rounds 2] [--buffers 8 32 128] [--iters 8]

Configurations:

- ``upstream``: as is; a microbatch is one sample (the named baseline "unpacked");
- ``dynbatch-B``: ``use_txt_dynamic_batching`` with ``max_seq_len`` = ``seq_length`` and
  ``dynamic_batch_buffer_size`` B: a microbatch is one of upstream's packs; the B with the most
  samples/s (median over rounds) is the named baseline "dynbatch best";
- ``flowtrain``: ``--use-flowtrain`` (the plugin's packing loader: packs of up to
  ``seq_length`` tokens).  Whether a run really packed is read from its batches and printed.

Rounds are interleaved (every configuration once per round, in the same order), so a change in
the machine's load reaches all of them alike.  Per run: step times are Megatron's logged
"elapsed time per iteration" after ``--warmup`` iterations; samples/s divides the samples fed
in those iterations (the harness's batch observer reads the sample tags back from the model's
``input_ids``; whether Megatron's logged consumed samples agree is printed) by their summed step
time; real tokens/s the tokens of the samples fed (padding left out) by the same time.  Prints
each run as it finishes (with the machine's load), then a table of medians over rounds with
ratios against the named baselines, and writes the numbers (JSON) and a PNG of every round.
"""

from __future__ import annotations

import argparse
import json
import os
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

from realjob import run_real_job  # noqa: E402
from realjob_run import RealRun  # noqa: E402
from realjob_transformers import TransformersJob  # noqa: E402

FLOW = ("--use-flowtrain",)


def configurations(buffers: list[int], job: TransformersJob) -> dict[str, TransformersJob]:
    """The benchmark's jobs by name (see the module docstring)."""
    configs = {"upstream": job}
    for size in buffers:
        configs[f"dynbatch-{size}"] = replace(job, yaml_patch=(
            ("gpt_args.use_txt_dynamic_batching", True), ("gpt_args.max_seq_len", job.seq_length),
            ("gpt_args.dynamic_batch_buffer_size", size)))
    configs["flowtrain"] = replace(job, plugin=FLOW)
    return configs


def measure(run: RealRun, warmup: int) -> dict:
    """Step time, samples/s and real tokens/s of one run after ``warmup`` iterations."""
    logged = run.logged
    timed = [i for i in sorted(logged) if i > warmup]
    if not timed:
        raise SystemExit(f"{run.workdir}: no iteration after the {warmup} warm-up ones was logged")
    steps = [float(logged[i]["elapsed time per iteration (ms)"]) / 1000.0 for i in timed]
    fed = {iteration: len(tags) for iteration, _, tags in run.fed}
    samples = sum(fed.get(i, 0) for i in timed)
    consumed = run.consumed[timed[-1]] - run.consumed[timed[0] - 1]
    tokens = run.real_tokens_per_iteration()
    batches = [b for b in run.batches if b["training"]]
    return {"step_s": statistics.median(steps), "samples_per_s": samples / sum(steps),
            "consumed_is_fed": consumed == samples,
            "tokens_per_s": sum(tokens.get(i, 0) for i in timed) / sum(steps),
            "samples_per_microbatch": statistics.mean(len(b["rows"][0][0]["tags"]) for b in batches),
            "tokens_per_microbatch": statistics.mean(b["real_tokens"] for b in batches), "wall_s": run.wall_s}


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.1f} / {five:.1f} / {fifteen:.1f} on {os.cpu_count()} CPUs"


def medians(rounds: list[dict]) -> dict[str, dict]:
    names = rounds[0].keys()
    return {name: {key: statistics.median(r[name][key] for r in rounds)
                   for key in ("step_s", "samples_per_s", "tokens_per_s", "samples_per_microbatch",
                               "tokens_per_microbatch")} for name in names}


def report(summary: dict[str, dict]) -> tuple[str, str]:
    """The table, with ratios against upstream unpacked and upstream's best dynamic batching."""
    dyn = [name for name in summary if name.startswith("dynbatch-")]
    best = max(dyn, key=lambda n: summary[n]["samples_per_s"]) if dyn else None
    lines = [f"{'config':<14}{'step s':>8}{'samples/mb':>11}{'tokens/mb':>10}{'samples/s':>11}{'tokens/s':>10}"
             f"{'samples/s vs unpacked':>23}{'vs dynbatch best':>18}{'tokens/s vs unpacked':>22}"
             f"{'vs dynbatch best':>18}"]
    for name, r in summary.items():
        base, dbest = summary["upstream"], summary.get(best) if best else None

        def ratio(key, ref):
            return f"{r[key] / ref[key]:.2f}x" if ref else "n/a"

        lines.append(f"{name:<14}{r['step_s']:>8.2f}{r['samples_per_microbatch']:>11.1f}"
                     f"{r['tokens_per_microbatch']:>10.0f}{r['samples_per_s']:>11.2f}{r['tokens_per_s']:>10.0f}"
                     f"{ratio('samples_per_s', base):>23}{ratio('samples_per_s', dbest):>18}"
                     f"{ratio('tokens_per_s', base):>22}{ratio('tokens_per_s', dbest):>18}")
    return "\n".join(lines), best or "none"


def draw(rounds: list[dict], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    xs = range(1, len(rounds) + 1)
    for name in rounds[0]:
        for ax, key in zip(axes, ("samples_per_s", "tokens_per_s")):
            ax.plot(list(xs), [r[name][key] for r in rounds], marker="o", label=name)
    for ax, label in zip(axes, ("samples/s", "real tokens/s")):
        ax.set_xlabel("round")
        ax.set_ylabel(label)
        ax.set_xticks(list(xs))
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--buffers", type=int, nargs="+", default=[8, 32, 128],
                        help="dynamic_batch_buffer_size values of upstream's dynamic batching")
    parser.add_argument("--iters", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first iterations left out of the timing")
    parser.add_argument("--seq-length", type=int, default=1024, help="pack capacity (max_seq_len / --seq-length)")
    parser.add_argument("--samples", type=int, default=480, help="corpus size (enough for every config's steps)")
    parser.add_argument("--only", nargs="+", default=None, help="configuration names to run (default: all)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per run")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench_qwen3vl")
    args = parser.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench_qwen3vl_"))
    args.out.mkdir(parents=True, exist_ok=True)
    base = TransformersJob(iters=args.iters, seq_length=args.seq_length, samples=args.samples,
                           timeout_s=args.timeout)
    configs = configurations(args.buffers, base)
    if args.only:
        configs = {name: job for name, job in configs.items() if name in args.only}
    total = args.rounds * len(configs)
    print(f"{total} runs ({args.rounds} rounds x {', '.join(configs)}), in {root}; {load()}", flush=True)
    started, rounds, loads = time.monotonic(), [], [load()]
    for index in range(args.rounds):
        this: dict = {}
        for name, job in configs.items():
            run = run_real_job(job, root / f"round{index + 1}" / name, check=False,
                               assets=root / f"assets_{args.samples}")
            if run.returncode != 0:
                raise SystemExit(f"round {index + 1} {name} failed; its output is in {run.workdir}\n"
                                 f"{run.output[-3000:]}")
            this[name] = measure(run, args.warmup)
            done = index * len(configs) + len(this)
            print(f"[{done}/{total} {time.monotonic() - started:.0f} s] round {index + 1} {name}: "
                  f"{this[name]['samples_per_s']:.2f} samples/s, {this[name]['tokens_per_s']:.0f} tokens/s, "
                  f"{this[name]['samples_per_microbatch']:.1f} samples per microbatch, logged consumed samples "
                  f"{'==' if this[name]['consumed_is_fed'] else '!='} fed, run {run.wall_s:.0f} s; "
                  f"{load()}", flush=True)
        rounds.append(this)
        loads.append(load())
    summary = medians(rounds)
    table, best = report(summary)
    title = (f"pretrain_transformers.py, tiny Qwen3-VL, CPU, global batch {base.gbs} x micro batch 1, capacity "
             f"{args.seq_length}; {args.iters} iterations ({args.warmup} warm-up); {args.rounds} interleaved rounds")
    print(f"\n{title}\nmedians over rounds; dynbatch best: {best}; load before/after each round: {'; '.join(loads)}")
    print(table)
    print("(samples/mb, tokens/mb: samples and real tokens per microbatch; ratios: this row's over the named "
          "baseline's)")
    (args.out / "results.json").write_text(json.dumps({"rounds": rounds, "summary": summary, "dynbatch_best": best,
                                                      "loads": loads, "title": title}, indent=1))
    png = draw(rounds, args.out / "rounds.png", title)
    print(f"numbers: {args.out / 'results.json'}; chart: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
