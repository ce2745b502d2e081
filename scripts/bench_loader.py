#!/usr/bin/env python
"""Loader benchmark: FlowDataLoader (online packing) against torch ``DataLoader`` +
``DistributedSampler`` with pad-to-longest batching, on the same demo corpus, in one run.

Both pipelines decode with the same code (:class:`mindspeed_flow.data.decode.Decoder`:
tokenizer, Pillow images, M-RoPE ids) in the same number of worker processes, so the
difference is what a step holds:

- **ours**: one pack of at most ``--capacity`` tokens per microbatch, no padding inside the
  batch (varlen attention reads ``cu_seqlens``); the unused part of the capacity is
  reported as its padding (what a static-shape step would pad to).
- **baseline**: ``DistributedSampler(shuffle=True, seed)`` and batches of ``B`` samples padded
  to the longest in the batch, ``B`` at its best for the same token budget: the largest
  ``B`` whose every padded batch ``B x longest`` fits ``--capacity`` on this corpus (found
  from the sample lengths; a larger ``B`` would overflow the step's memory on some batch).

Reported per pipeline: real tokens per step, padding fraction, tokens per second of the
whole pipeline (decode + batch) and the ratios ours / baseline.

    python scripts/bench_loader.py                        # 1500 samples, capacity 4096, 2 workers
    python scripts/bench_loader.py --samples 300 --capacity 2048 --json out.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.conversation import IGNORE
from mindspeed_flow.data.decode import BadSample, Decoder
from mindspeed_flow.data.demo import make_demo_corpus
from mindspeed_flow.data.images import normalize
from mindspeed_flow.data.source import Corpus
from mindspeed_flow.data.tokenizer import load_tokenizer


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
                "pixel_values": normalize(torch.cat([s.pixel_values for s in samples])),
                "image_grid_thw": torch.cat([s.image_grid_thw for s in samples])}


def run_ours(corpus: Path, args) -> tuple[dict, dict[str, int]]:
    loader = FlowDataLoader(corpus, None, capacity=args.capacity, num_workers=args.workers, seed=args.seed,
                            window=args.window, max_pixels=args.max_pixels)
    lengths: dict[str, int] = {}
    start = time.perf_counter()
    for batch in tqdm(loader, desc="FlowDataLoader", unit="pack"):
        cu = batch["cu_seqlens"].tolist()
        lengths.update((sid, hi - lo) for sid, lo, hi in zip(batch["sample_ids"], cu[:-1], cu[1:]))
    seconds = time.perf_counter() - start
    s = loader.stats
    return {"steps": s.packs, "tokens": s.tokens, "slots": s.packs * args.capacity, "seconds": seconds,
            "config": f"capacity {args.capacity}, window {args.window}"}, lengths


def best_batch_size(order: list[int], lengths: list[int], capacity: int) -> int:
    """Largest B whose every batch (in sampler order) padded to its longest fits ``capacity``."""
    best = 1
    for b in range(1, capacity + 1):
        batches = [order[i:i + b] for i in range(0, len(order), b)]
        if any(len(batch) * max(lengths[i] for i in batch) > capacity for batch in batches):
            break
        best = b
    return best


def run_baseline(corpus: Path, args, lengths_by_id: dict[str, int]) -> dict:
    c = Corpus.open(corpus)
    tokenizer = load_tokenizer(None, corpus)
    decoder = Decoder(c, tokenizer, max_pixels=args.max_pixels)
    dataset = DecodedRecords(decoder)
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=args.seed)
    order = list(sampler)
    lengths = [lengths_by_id[c.place(i)] for i in range(len(c))]
    batch_size = best_batch_size(order, lengths, args.capacity)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=args.workers,
                        collate_fn=PadToLongest(tokenizer.special.pad))
    steps = tokens = slots = 0
    start = time.perf_counter()
    for batch in tqdm(loader, desc=f"DataLoader B={batch_size}", unit="batch"):
        steps += 1
        tokens += int(batch["attention_mask"].sum())
        slots += batch["input_ids"].numel()
    seconds = time.perf_counter() - start
    return {"steps": steps, "tokens": tokens, "slots": slots, "seconds": seconds,
            "config": f"DistributedSampler + pad-to-longest, batch size {batch_size} (best within capacity)"}


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
            "tokens_per_s": run["tokens"] / run["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1500)
    parser.add_argument("--capacity", type=int, default=4096)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--max-pixels", type=int, default=262144)
    parser.add_argument("--corpus", type=Path, help="an existing corpus (default: a fresh demo corpus)")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--prefetch-effect", action="store_true",
                        help="instead: measure decoding ahead in workers against no prefetch (see run_prefetch_effect)")
    parser.add_argument("--prefetch-packs", type=int, default=40, help="steps timed by --prefetch-effect")
    parser.add_argument("--step-ms", type=float, default=100.0, help="simulated device time per step (--prefetch-effect)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = args.corpus or make_demo_corpus(Path(tmp) / "corpus", samples=args.samples, seed=0)
        if args.prefetch_effect:
            return run_prefetch_effect(corpus, args)
        ours, lengths = run_ours(corpus, args)
        base = run_baseline(corpus, args, lengths)
    ours, base = summary(ours), summary(base)
    print(f"\ncorpus: {len(lengths)} samples, {sum(lengths.values())} tokens, capacity {args.capacity}, "
          f"{args.workers} workers")
    print(f"{'pipeline':<12}{'steps':>7}{'tokens/step':>13}{'padding':>9}{'tokens/s':>11}  config")
    for name, r in (("ours", ours), ("baseline", base)):
        print(f"{name:<12}{r['steps']:>7}{r['tokens_per_step']:>13.1f}{r['padding']:>9.2%}{r['tokens_per_s']:>11.0f}  "
              f"{r['config']}")
    ratios = {"tokens_per_step": ours["tokens_per_step"] / base["tokens_per_step"],
              "tokens_per_s": ours["tokens_per_s"] / base["tokens_per_s"]}
    print(f"ours / baseline: tokens per step x{ratios['tokens_per_step']:.2f}, "
          f"tokens per second x{ratios['tokens_per_s']:.2f}; goal: >= x2 tokens per step at < 2% padding "
          f"({'met' if ratios['tokens_per_step'] >= 2 and ours['padding'] < 0.02 else 'NOT met'})")
    if args.json:
        args.json.write_text(json.dumps({"ours": ours, "baseline": base, "ratios": ratios, "args": vars(args)},
                                        default=str, indent=1))


if __name__ == "__main__":
    main()
