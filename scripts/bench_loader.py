#!/usr/bin/env python
"""Loader benchmark: FlowDataLoader (online packing) against two torch ``DataLoader``
baselines with pad-to-longest batching, on the same demo corpus, rounds interleaved.

All pipelines decode with the same code (:class:`mindspeed_flow.data.decode.Decoder`:
tokenizer, Pillow images, M-RoPE ids) in the same number of worker processes, so the
difference is what a step holds and where the batch is joined:

- **ours**: one pack of at most ``--capacity`` tokens per microbatch, no padding inside the
  batch (varlen attention reads ``cu_seqlens``); the unused part of the capacity is
  reported as its padding (what a static-shape step would pad to).
- **pad-to-longest**: ``DistributedSampler(shuffle=True, seed)`` and batches of ``B`` samples
  padded to the longest in the batch (MindSpeed-MM's default collator).
- **length-grouped**: the same collator over batches of samples of similar length, as
  MindSpeed-MM's ``LengthGroupedSampler`` (and Hugging Face's ``group_by_length``) make
  them: a seeded permutation cut into megabatches of ``--group-batches x B`` samples, each
  sorted by length and cut into batches, the batches shuffled.  MindSpeed-MM's own sampler
  groups ``world_size x B`` samples, which on one DP rank is a single batch (no grouping):
  the wider megabatch (Hugging Face's cap of 50 batches) is the baseline at its best.

Each baseline's ``B`` is its best for the same token budget: the largest ``B`` whose every
padded batch ``B x longest`` fits ``--capacity`` on this corpus in its own batch order (a
larger ``B`` would overflow the step's memory on some batch).

Our ``--window`` (default 8) is a look-ahead that already reaches the lower bound (53 packs,
1.19% padding) on the default corpus.  A window with room for the whole epoch (64 x 4096 tokens
> this corpus's 214499) leaves most packs open until the epoch's end (43 of 53 closed by the
final flush), so their join cannot overlap decoding: a one-epoch artefact of a small corpus,
which a training epoch over a real corpus (window << epoch) does not have.

The machine may be loaded by other jobs, so rounds are interleaved (ours, pad-to-longest,
length-grouped, ours, ...) and every ratio is per round (ours over that round's baseline),
then the median over rounds.  Reported per pipeline and round: steps, real (non-padding)
tokens per step, padding fraction and raw tokens per second of the whole pipeline (worker
start, decode, batch; tokens are real tokens).  The *best baseline* is the one with the
higher median tokens per second; the goal is ours >= 1.0x its raw tokens/s at >= 2x its
real tokens per step.

    python scripts/bench_loader.py                        # 1500 samples, capacity 4096, window 8, 2 workers, 3 rounds
    python scripts/bench_loader.py --samples 300 --capacity 2048 --rounds 2 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.conversation import IGNORE
from mindspeed_flow.data.decode import BadSample, Decoder
from mindspeed_flow.data.demo import make_demo_corpus
from mindspeed_flow.data.images import normalize_joined
from mindspeed_flow.data.source import Corpus
from mindspeed_flow.data.tokenizer import load_tokenizer

OURS, PAD, GROUPED = "ours", "pad-to-longest", "length-grouped"
BASELINES = (PAD, GROUPED)
Batches = list[list[int]]


class DecodedRecords(Dataset):
    """Map-style dataset: record ``i`` decoded by the same decoder the loader uses."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder = decoder

    def __len__(self) -> int:
        return len(self.decoder.corpus)

    def __getitem__(self, index: int):
        sample = self.decoder(index)
        if isinstance(sample, BadSample):
            raise ValueError(sample.reason)
        return sample


class PadToLongest:
    """Collate ``B`` samples into ``[B, longest]`` rows (right padding), as MindSpeed-MM's collator does."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, samples):
        longest = max(len(s) for s in samples)
        input_ids = torch.full((len(samples), longest), self.pad_id, dtype=torch.int64)
        labels = torch.full((len(samples), longest), IGNORE, dtype=torch.int64)
        mask = torch.zeros((len(samples), longest), dtype=torch.int64)
        for row, s in enumerate(samples):
            input_ids[row, :len(s)] = s.input_ids
            labels[row, :len(s)] = s.labels
            mask[row, :len(s)] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": mask,
                "pixel_values": normalize_joined([s.pixel_values for s in samples]),
                "image_grid_thw": torch.cat([s.image_grid_thw for s in samples])}


def run_ours(corpus: Path, args) -> tuple[dict, dict[str, int]]:
    """One epoch of our loader: its counts and the token length of every sample it packed."""
    loader = FlowDataLoader(corpus, None, capacity=args.capacity, num_workers=args.workers, seed=args.seed,
                            window=args.window, max_pixels=args.max_pixels)
    lengths: dict[str, int] = {}
    start, cpu = time.perf_counter(), cpu_seconds()
    for batch in tqdm(loader, desc=OURS, unit="pack", leave=False):
        cu = batch["cu_seqlens"].tolist()
        lengths.update((sid, hi - lo) for sid, lo, hi in zip(batch["sample_ids"], cu[:-1], cu[1:]))
    seconds = time.perf_counter() - start
    s = loader.stats
    return {"steps": s.packs, "tokens": s.tokens, "slots": s.packs * args.capacity, "seconds": seconds,
            "cpu_s": cpu_seconds() - cpu, "config": f"capacity {args.capacity}, window {args.window}"}, lengths


def cpu_seconds() -> float:
    """CPU time of this process (all its threads) and of its exited workers: the work a
    pipeline costs, which other jobs on the machine do not change (wall time they do).  The
    workers of an epoch exit at its end, so after a pipeline's run its workers are counted."""
    own, workers = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + workers.ru_utime + workers.ru_stime


def sampler_batches(order: list[int], batch_size: int) -> Batches:
    """``DistributedSampler``'s order cut into batches of ``batch_size`` (the last one shorter)."""
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def length_grouped_batches(lengths: list[int], batch_size: int, group_batches: int, seed: int) -> Batches:
    """Batches of similar length: a seeded permutation cut into megabatches of
    ``group_batches * batch_size`` samples, each sorted by length (longest first) and cut
    into batches of ``batch_size``; the batches then shuffled (seeded).  Written from the
    description of MindSpeed-MM's ``LengthGroupedSampler`` / Hugging Face's grouping."""
    rng = random.Random(seed)
    order = list(range(len(lengths)))
    rng.shuffle(order)
    mega = group_batches * batch_size
    batches: Batches = []
    for i in range(0, len(order), mega):
        grouped = sorted(order[i:i + mega], key=lambda k: lengths[k], reverse=True)
        batches.extend(grouped[j:j + batch_size] for j in range(0, len(grouped), batch_size))
    rng.shuffle(batches)
    return batches


def best_batch_size(batches_for: Callable[[int], Batches], lengths: list[int], capacity: int) -> int:
    """Largest ``B`` whose every batch (``batches_for(B)``, in the sampler's order) padded to
    its longest fits ``capacity``; ``B`` cannot exceed ``capacity // longest sample``."""
    fitting = [b for b in range(1, max(1, capacity // max(lengths)) + 1)
               if all(len(batch) * max(lengths[i] for i in batch) <= capacity for batch in batches_for(b))]
    return max(fitting, default=1)


class Baseline:
    """One baseline pipeline: its batch order at its best ``B`` (fixed for every round)."""

    def __init__(self, name: str, corpus: Path, args, lengths_by_id: dict[str, int]) -> None:
        self.name, self.args = name, args
        c = Corpus.open(corpus)
        self.tokenizer = load_tokenizer(None, corpus)
        self.dataset = DecodedRecords(Decoder(c, self.tokenizer, max_pixels=args.max_pixels))
        lengths = [lengths_by_id[c.place(i)] for i in range(len(c))]
        if name == PAD:
            order = list(DistributedSampler(self.dataset, num_replicas=1, rank=0, shuffle=True, seed=args.seed))
            batches_for = lambda b: sampler_batches(order, b)  # noqa: E731
            how = "DistributedSampler + pad-to-longest"
        else:
            batches_for = lambda b: length_grouped_batches(lengths, b, args.group_batches, args.seed)  # noqa: E731
            how = f"length-grouped (megabatches of {args.group_batches} batches) + pad-to-longest"
        self.batch_size = best_batch_size(batches_for, lengths, args.capacity)
        self.batches = batches_for(self.batch_size)
        self.config = f"{how}, batch size {self.batch_size} (best within capacity)"

    def run(self) -> dict:
        loader = DataLoader(self.dataset, batch_sampler=self.batches, num_workers=self.args.workers,
                            collate_fn=PadToLongest(self.tokenizer.special.pad))
        steps = tokens = slots = 0
        start, cpu = time.perf_counter(), cpu_seconds()
        for batch in tqdm(loader, desc=f"{self.name} B={self.batch_size}", unit="batch", leave=False):
            steps += 1
            tokens += int(batch["attention_mask"].sum())
            slots += batch["input_ids"].numel()
        seconds = time.perf_counter() - start
        return {"steps": steps, "tokens": tokens, "slots": slots, "seconds": seconds, "cpu_s": cpu_seconds() - cpu,
                "config": self.config}


def run_prefetch_effect(corpus: Path, args) -> None:
    """``--prefetch-effect``: wall time of ``--prefetch-packs`` training steps of ``--step-ms``
    each (a sleep: the host is idle while the device computes) fed by our loader decoding
    in the training process (no prefetch, the baseline) or ahead in ``--workers`` workers
    with ``prefetch_factor`` 1 and 8 (the default)."""
    configs = [("no prefetch (0 workers)", 0, 8), (f"{args.workers} workers, prefetch 1", args.workers, 1),
               (f"{args.workers} workers, prefetch 8", args.workers, 8)]
    times = {}
    for name, workers, factor in configs:
        loader = FlowDataLoader(corpus, None, capacity=args.capacity, num_workers=workers, seed=args.seed,
                                window=args.window, max_pixels=args.max_pixels, prefetch_factor=factor)
        batches = iter(loader)
        next(batches)  # start-up (worker spawn, first decode) is not part of the steady state
        start, steps = time.perf_counter(), 0
        for _ in tqdm(itertools.islice(batches, args.prefetch_packs), desc=name, unit="step"):
            time.sleep(args.step_ms / 1000)
            steps += 1
        times[name] = (time.perf_counter() - start) / steps
        del batches, loader
    base = times[configs[0][0]]
    print(f"\nup to {args.prefetch_packs} steps of {args.step_ms} ms simulated device time, capacity {args.capacity}")
    for name, seconds in times.items():
        print(f"{name:<28}{seconds * 1000:>8.1f} ms/step   x{base / seconds:.2f} vs no prefetch")


def summary(run: dict) -> dict:
    return {**run, "tokens_per_step": run["tokens"] / run["steps"], "padding": 1 - run["tokens"] / run["slots"],
            "tokens_per_s": run["tokens"] / run["seconds"], "cpu_ms_per_1k_tokens": 1e6 * run["cpu_s"] / run["tokens"]}


def interleaved_rounds(corpus: Path, args) -> dict:
    """A warm-up epoch of ours (the sample lengths the baselines' ``B`` is chosen from; the
    files enter the page cache), then ``--rounds`` rounds of ours and each baseline, in turn."""
    _, lengths = run_ours(corpus, args)
    baselines = [Baseline(name, corpus, args, lengths) for name in BASELINES]
    rounds = []
    for r in range(args.rounds):
        ours, _ = run_ours(corpus, args)
        row = {OURS: summary(ours), **{b.name: summary(b.run()) for b in baselines}}
        row["ratios"] = {name: ratios(row[OURS], row[name]) for name in BASELINES}
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{name} {row[name]['tokens_per_s']:.0f} tokens/s" for name in
                                             (OURS, *BASELINES)), flush=True)
    medians = {name: {key: statistics.median(row[name][key] for row in rounds)
                      for key in ("tokens_per_s", "tokens_per_step", "padding", "steps", "cpu_ms_per_1k_tokens")}
               for name in (OURS, *BASELINES)}
    median_ratios = {name: {key: statistics.median(row["ratios"][name][key] for row in rounds)
                            for key in ("tokens_per_s", "tokens_per_step")} for name in BASELINES}
    best = max(BASELINES, key=lambda name: medians[name]["tokens_per_s"])
    goal = median_ratios[best]["tokens_per_s"] >= 1.0 and median_ratios[best]["tokens_per_step"] >= 2.0
    return {"samples": len(lengths), "tokens": sum(lengths.values()), "rounds": rounds, "medians": medians,
            "median_ratios": median_ratios, "best_baseline": best, "goal_met": goal,
            "configs": {OURS: rounds[0][OURS]["config"], **{b.name: b.config for b in baselines}}}


def ratios(ours: dict, base: dict) -> dict:
    return {"tokens_per_s": ours["tokens_per_s"] / base["tokens_per_s"],
            "tokens_per_step": ours["tokens_per_step"] / base["tokens_per_step"]}


def print_report(result: dict, args) -> None:
    print(f"\ncorpus: {result['samples']} samples, {result['tokens']} tokens, capacity {args.capacity}, "
          f"{args.workers} workers, {args.rounds} interleaved rounds")
    for name, config in result["configs"].items():
        print(f"  {name}: {config}")
    print(f"\n{'round':<7}{'pipeline':<16}{'steps':>6}{'tokens/step':>13}{'padding':>9}{'tokens/s':>10}"
          f"{'CPU ms/1k tok':>15}{'x tokens/s':>12}{'x tokens/step':>15}")
    for r, row in enumerate(result["rounds"], start=1):
        for name in (OURS, *BASELINES):
            run = row[name]
            vs = "" if name == OURS else (f"{row['ratios'][name]['tokens_per_s']:>12.2f}"
                                          f"{row['ratios'][name]['tokens_per_step']:>15.2f}")
            print(f"{r:<7}{name:<16}{run['steps']:>6}{run['tokens_per_step']:>13.1f}{run['padding']:>9.2%}"
                  f"{run['tokens_per_s']:>10.0f}{run['cpu_ms_per_1k_tokens']:>15.1f}{vs}")
    print("\nmedian over rounds (x = ours / that baseline, per round, then the median):")
    for name in (OURS, *BASELINES):
        m = result["medians"][name]
        vs = "" if name == OURS else (f"   ours x{result['median_ratios'][name]['tokens_per_s']:.2f} tokens/s, "
                                      f"x{result['median_ratios'][name]['tokens_per_step']:.2f} real tokens/step")
        print(f"  {name:<16}{m['tokens_per_s']:>8.0f} tokens/s {m['tokens_per_step']:>8.1f} tokens/step "
              f"{m['padding']:>7.2%} padding {m['cpu_ms_per_1k_tokens']:>6.1f} CPU ms/1k tokens{vs}")
    best = result["best_baseline"]
    print(f"best baseline (median tokens/s): {best}; goal >= x1.0 its tokens/s at >= x2 its real tokens/step: "
          f"{'met' if result['goal_met'] else 'NOT met'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1500)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--window", type=int, default=None,
                        help="our packer's look-ahead (open packs); default 8, which already reaches the lower "
                             "bound on the default corpus (64 with --prefetch-effect, as its numbers in "
                             "docs/recipes.md were measured)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--max-pixels", type=int, default=262144)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (ours, each baseline)")
    parser.add_argument("--group-batches", type=int, default=50,
                        help="length-grouped baseline: batches per megabatch sorted by length")
    parser.add_argument("--corpus", type=Path, help="an existing corpus (default: a fresh demo corpus)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--prefetch-effect", action="store_true",
                        help="instead: measure decoding ahead in workers against no prefetch (see run_prefetch_effect)")
    parser.add_argument("--prefetch-packs", type=int, default=40, help="steps timed by --prefetch-effect")
    parser.add_argument("--step-ms", type=float, default=100.0, help="simulated device time per step (--prefetch-effect)")
    args = parser.parse_args()
    if args.window is None:
        args.window = 64 if args.prefetch_effect else 8
    with tempfile.TemporaryDirectory() as tmp:
        corpus = args.corpus or make_demo_corpus(Path(tmp) / "corpus", samples=args.samples, seed=0)
        if args.prefetch_effect:
            return run_prefetch_effect(corpus, args)
        result = interleaved_rounds(corpus, args)
    print_report(result, args)
    if args.json:
        args.json.write_text(json.dumps({**result, "args": vars(args)}, default=str, indent=1))


if __name__ == "__main__":
    main()
