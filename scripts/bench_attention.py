#!/usr/bin/env python
"""Varlen attention vs a dense S x S mask, and Matmul vs Conv3d patch embedding, on this CPU.

Every ratio is computed from baselines measured in the same run:

* attention, for packs of 8K and 32K tokens filled with a seeded VLM-like sample mix
  (text-only, single-image and multi-image samples; Qwen2-VL token counts):
  - ``dense``: what upstream does without varlen: build the pack's block mask
    ([S, S] bool) and run SDPA with it (the most favourable dense baseline: a fused kernel,
    no fp32 [H, S, S] score tensor as Megatron's unfused path would allocate);
  - ``varlen``: :func:`mindspeed_flow.attention.varlen_attention` (SDPA per segment here).
  LLM layers are causal; ViT layers are bidirectional over image-patch segments.
  8K packs run forward+backward, 32K packs forward only (the dense backward at 32K takes
  minutes on 2 cores); packs larger than ``--backward-up-to`` run the LLM mix only (the
  dense side costs the same for the ViT mix), so raise it to get the ViT pack at 32K.
* patch embedding: Qwen2-VL's Conv3d(3, 1280, [2, 14, 14]) vs PatchEmbedMatmul on the same
  weights and pixels, forward and forward+backward.

Peak memory is what the case allocates (mask, workspace, outputs, saved tensors), inputs
excluded: on CPU the rise of the process's peak resident set, on CUDA (``--device cuda``)
the caching allocator's peak.  Time is the best of ``--repeats`` runs (use 2 or more on
CUDA, where the first includes kernel selection).  Heads and head dim are reduced (default 4 x 64, not e.g. 28 x 128) to
fit 2 cores; both sides scale the same way with them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mindspeed_flow.attention import varlen_attention
from mindspeed_flow.attention.patch_embed import PatchEmbedMatmul
from mindspeed_flow.attention.reference import segment_mask

PATCH = 14
MERGE = 2  # Qwen2-VL merges 2x2 patches into one LLM token


@dataclass
class Case:
    name: str
    tokens: int
    segments: int
    longest: int
    backward: bool
    dense_s: float
    dense_mb: float
    varlen_s: float
    varlen_mb: float
    max_abs_diff: float

    @property
    def speedup(self) -> float:
        return self.dense_s / self.varlen_s

    @property
    def memory_saving(self) -> float:
        return 1.0 - self.varlen_mb / self.dense_mb if self.dense_mb > 0 else float("nan")


M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


def return_freed_memory_at_once() -> None:
    """Make glibc serve every allocation over 64 KiB by mmap and unmap it on free.

    Otherwise glibc raises its mmap threshold after large frees and later cases reuse the
    heap a previous case grew, so their resident-set peak would be under-counted.
    """
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(fn: Callable[[], torch.Tensor], repeats: int, device: torch.device) -> tuple[float, float, torch.Tensor]:
    """(best seconds, peak MB above what was allocated before, last output).

    CPU: the process's peak resident set (VmHWM, reset through /proc/self/clear_refs).
    CUDA: the caching allocator's peak allocation, with a synchronise around the timing.
    """
    best, peak, out = math.inf, 0.0, None
    cuda = device.type == "cuda"
    for _ in range(repeats):
        out = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() / 2**20
        else:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # resets VmHWM to the current resident set
            before = _status_mb("VmRSS")
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
        high = torch.cuda.max_memory_allocated() / 2**20 if cuda else _status_mb("VmHWM")
        peak = max(peak, high - before)
    return best, peak, out


def image_tokens(rng: random.Random) -> int:
    """LLM tokens of one image at a random native resolution (224..1344 px a side)."""
    h, w = (rng.randrange(224, 1345, PATCH * MERGE) for _ in range(2))
    return (h // PATCH // MERGE) * (w // PATCH // MERGE)


def llm_sample(rng: random.Random) -> int:
    """Tokens of one VLM SFT sample: 35% text only, 55% one image, 10% 2-4 images."""
    text = int(min(4096, max(16, rng.lognormvariate(math.log(220), 0.8))))
    kind = rng.random()
    if kind < 0.35:
        return text
    images = 1 if kind < 0.90 else rng.randint(2, 4)
    return text + sum(image_tokens(rng) for _ in range(images))


def vit_sample(rng: random.Random) -> int:
    """Patches of one image seen by the ViT (before the 2x2 merge)."""
    return image_tokens(rng) * MERGE * MERGE


def fill_pack(capacity: int, sample: Callable[[random.Random], int], seed: int) -> list[int]:
    """Samples in arrival order until the pack is full; the last one is cut to fit."""
    rng, lengths = random.Random(seed), []
    while sum(lengths) < capacity:
        lengths.append(min(sample(rng), capacity - sum(lengths)))
    return lengths


def bench_attention(name: str, lengths: list[int], causal: bool, heads: int, dim: int,
                    backward: bool, repeats: int, device: torch.device, dtype: torch.dtype) -> Case:
    total = sum(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(total, heads, dim, generator=gen).to(device, dtype).requires_grad_(backward)
               for _ in range(3))
    grad = torch.randn(total, heads, dim, generator=gen).to(device, dtype)

    def run(attend: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def case() -> torch.Tensor:
            out = attend()
            if backward:
                out.backward(grad)
            return out.detach()
        return case

    def dense() -> torch.Tensor:
        mask = segment_mask(cu, cu, total, total, causal, device=device)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask)
        return out[0].transpose(0, 1)

    def varlen() -> torch.Tensor:
        return varlen_attention(q, k, v, cu, cu, causal)

    with torch.set_grad_enabled(backward):
        dense_s, dense_mb, dense_out = measure(run(dense), repeats, device)
        varlen_s, varlen_mb, varlen_out = measure(run(varlen), repeats, device)
    return Case(name, total, len(lengths), max(lengths), backward, dense_s, dense_mb, varlen_s, varlen_mb,
                (dense_out.float() - varlen_out.float()).abs().max().item())


def bench_patch_embed(patches: int, repeats: int, device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 1280, (2, PATCH, PATCH), stride=(2, PATCH, PATCH), bias=False).to(device, dtype)
    matmul = PatchEmbedMatmul.from_conv(conv)
    pixels = torch.randn(patches, 3, 2, PATCH, PATCH).to(device, dtype)
    result: dict[str, float] = {"patches": patches}
    for label, module in (("conv3d", conv), ("matmul", matmul)):
        with torch.no_grad():
            result[f"{label}_fwd_s"] = measure(lambda: module(pixels), repeats, device)[0]
        result[f"{label}_fwd_bwd_s"] = measure(lambda: _fwd_bwd(module, pixels), repeats, device)[0]
    result["fwd_speedup"] = result["conv3d_fwd_s"] / result["matmul_fwd_s"]
    result["fwd_bwd_speedup"] = result["conv3d_fwd_bwd_s"] / result["matmul_fwd_bwd_s"]
    return result


def _fwd_bwd(module: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    module.zero_grad(set_to_none=True)
    out = module(pixels.requires_grad_(True))
    out.sum().backward()
    return out.detach()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 32768], help="pack sizes in tokens")
    parser.add_argument("--backward-up-to", type=int, default=8192,
                        help="packs up to this size also run backward")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--patches", type=int, default=4096, help="patches for the patch-embedding case")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the SDPA backend either way)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cpu":
        return_freed_memory_at_once()

    cases = []
    for size in args.sizes:
        backward = size <= args.backward_up_to
        for name, sample, causal in (("llm-causal", llm_sample, True), ("vit-full", vit_sample, False)):
            if size > args.backward_up_to and name == "vit-full":
                continue  # same dense cost as llm-causal at this size; keeps the run short
            lengths = fill_pack(size, sample, seed=size)
            cases.append(bench_attention(f"{name}-{size // 1024}K", lengths, causal, args.heads,
                                         args.head_dim, backward, args.repeats, device, dtype))
            print(_row(cases[-1]), flush=True)
    embed = bench_patch_embed(args.patches, args.repeats, device, dtype)
    print(f"patch embed {embed['patches']} patches: conv3d fwd {embed['conv3d_fwd_s']:.3f}s "
          f"fwd+bwd {embed['conv3d_fwd_bwd_s']:.3f}s | matmul fwd {embed['matmul_fwd_s']:.3f}s "
          f"fwd+bwd {embed['matmul_fwd_bwd_s']:.3f}s | speedup fwd {embed['fwd_speedup']:.1f}x "
          f"fwd+bwd {embed['fwd_bwd_speedup']:.1f}x")
    if args.json:
        payload = {"settings": vars(args) | {"json": str(args.json)},
                   "attention": [asdict(c) | {"speedup": c.speedup, "memory_saving": c.memory_saving}
                                 for c in cases],
                   "patch_embed": embed}
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


def _row(c: Case) -> str:
    return (f"{c.name:16s} {c.segments:3d} segs (longest {c.longest:5d}) {'fwd+bwd' if c.backward else 'fwd'} | "
            f"dense {c.dense_s:7.3f}s {c.dense_mb:8.1f}MB | varlen {c.varlen_s:7.3f}s {c.varlen_mb:7.1f}MB | "
            f"{c.speedup:5.1f}x faster, {100 * c.memory_saving:5.1f}% less memory | max|diff| {c.max_abs_diff:.1e}")


if __name__ == "__main__":
    raise SystemExit(main())
