#!/usr/bin/env python
"""Calibrate the packing ``CostModel`` from real forward+backward timings on this CPU.

A small decoder (pre-norm attention + MLP blocks) runs packs of different shapes, the
same token count cut into one long segment or many short ones, through the project's
varlen attention entry point (:func:`mindspeed_flow.attention.varlen_attention`, causal,
per segment), so the time has the linear-plus-per-segment-quadratic shape the model
assumes.  A small non-causal encoder does the same for calls of 1 to 16 images of different
patch counts.  ``CostModel.fit`` (non-negative least squares) estimates the coefficients; R^2
is reported on all packs and on packs held out of the fit.  The encoder's calls also fit the
flow's :class:`~mindspeed_flow.flow.EncoderCost` (``quadratic * sum p^2 + linear * sum p +
per_image * images``: the images per call vary, so the per-image term is identifiable),
written under the JSON's ``encoder_cost`` key, which a decoupled layout's
``flow_encoder_cost`` and the trainer's ``data.encoder_cost.file`` read.

    python scripts/calibrate_cost_model.py            # ~1 minute; writes outputs/cost_model.json
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from mindspeed_flow.attention import varlen_attention
from mindspeed_flow.flow import EncoderCost, SampleMeta
from mindspeed_flow.flow.encoder_cost import CALIBRATION_KEY
from mindspeed_flow.packing import CostModel, r_squared

ROOT = Path(__file__).resolve().parent.parent
# the encoder's calls, each a list of its images' patch counts: the same patches in one image
# or many (16 x 64 = 1024 = 1 x 1024), so the per-image term is told from the per-patch one
IMAGE_SETS = ([[p] * k for p in (64, 256, 576, 1024) for k in (1, 2)] + [[64, 1024], [256, 256, 576]]
              + [[64] * 4, [64] * 16, [16] * 16, [256] * 4])


class Block(nn.Module):
    """Pre-norm transformer block over a packed ``[tokens, hidden]`` sequence."""

    def __init__(self, hidden: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).view(x.shape[0], 3, self.heads, -1).unbind(1)
        attn = varlen_attention(q, k, v, cu_seqlens, cu_seqlens, causal=self.causal)
        x = x + self.proj(attn.reshape(x.shape))
        return x + self.mlp(self.norm2(x))


def seconds(model: nn.ModuleList, segments: list[int], hidden: int, reps: int) -> float:
    """Fastest of ``reps`` forward + backward runs of one pack (after one warm-up run):
    on a shared CPU the minimum is the run least disturbed by other processes."""
    cu = np.concatenate(([0], np.cumsum(segments))).tolist()
    times = []
    for rep in range(reps + 1):
        x = torch.randn(cu[-1], hidden, requires_grad=True)
        start = time.perf_counter()
        h = x
        for block in model:
            h = block(h, cu)
        h.square().mean().backward()
        if rep:
            times.append(time.perf_counter() - start)
    return min(times)


def pack_shapes(totals: list[int], rng: np.random.Generator) -> list[list[int]]:
    """For each token count: one segment, 2..16 equal segments, and two random splits."""
    shapes = []
    for total in totals:
        for parts in (1, 2, 4, 8, 16):
            shapes.append([total // parts] * parts)
        for _ in range(2):
            cuts = np.sort(rng.choice(np.arange(1, total), rng.integers(1, 12), replace=False))
            shapes.append(np.diff(np.concatenate(([0], cuts, [total]))).tolist())
    return shapes


def encoder_calls(images: list[tuple[list[int], float]]) -> list[tuple[list[SampleMeta], float]]:
    """The encoder's timed calls as :meth:`EncoderCost.fit` takes them: one sample per call
    holding its images' patch counts."""
    return [([SampleMeta(i, 0, 1, 0, tuple(patches))], t) for i, (patches, t) in enumerate(images)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--totals", type=int, nargs="*", default=[512, 1024, 2048, 3072, 4096])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "cost_model.json")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)
    llm = nn.ModuleList(Block(args.hidden, args.heads, causal=True) for _ in range(args.layers))
    encoder = nn.ModuleList(Block(args.hidden, args.heads, causal=False) for _ in range(args.layers))

    observations = [
        (shape, seconds(llm, shape, args.hidden, args.reps))
        for shape in tqdm(pack_shapes(args.totals, rng), desc="LLM packs")
    ]
    images = [(patches, seconds(encoder, patches, args.hidden, args.reps)) for patches in tqdm(IMAGE_SETS, desc="images")]

    model = CostModel.fit(observations, images=images)
    r2_all = r_squared(model, observations)
    held_out = CostModel.fit(observations[0::2])
    r2_held_out = r_squared(held_out, observations[1::2])
    # The encoder terms have the LLM terms' shape over patch counts (no constant).
    r2_images = r_squared(CostModel(linear=model.encoder_linear, quadratic=model.encoder_quadratic), images)

    calls = encoder_calls(images)
    encoder_cost = EncoderCost.fit(calls)
    r2_encoder_cost = r_squared(encoder_cost, calls)

    print(f"\nfitted: {model}")
    print(f"LLM packs: {len(observations)}, R^2 {r2_all:.4f}; fit on half, R^2 on the other half {r2_held_out:.4f}")
    print(f"encoder calls: {len(images)}, R^2 {r2_images:.4f}")
    print(f"flow's encoder cost: {encoder_cost}, R^2 {r2_encoder_cost:.4f}")
    share = [model.quadratic * sum(l * l for l in s) / model.cost(s) for s, _ in observations if len(s) == 1]
    print(f"attention share of a single-segment pack: {min(share):.1%} .. {max(share):.1%}")
    print(f"{'segments':>34} {'measured ms':>12} {'model ms':>9}")
    for shape, t in observations[:: max(1, len(observations) // 10)]:
        label = f"{len(shape)} x ~{sum(shape) // len(shape)} (sum {sum(shape)})"
        print(f"{label:>34} {t * 1e3:12.2f} {model.cost(shape) * 1e3:9.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": asdict(model), "r2": r2_all, "r2_held_out": r2_held_out, "r2_images": r2_images,
        CALIBRATION_KEY: asdict(encoder_cost), "r2_encoder_cost": r2_encoder_cost,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "observations": observations, "images": images,
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
