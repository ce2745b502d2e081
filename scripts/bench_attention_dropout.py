"""Attention dropout on CPU: memory and time of one long segment, forward + backward.

Baseline: PyTorch SDPA on the whole segment with ``dropout_p > 0`` (its own kernel choice,
the best it has on CPU: the flash kernel has no dropout, so it runs the math kernel and
builds the ``[H, L, L]`` scores).  Against it: ``varlen_attention`` with the same dropout,
which runs query blocks of ``sdpa.BLOCK`` rows and recomputes each in backward.  Memory is
the rise of the process's peak resident set during the case (as in ``bench_attention.py``);
time is the best of ``--repeats``.  Prints ratios against the baseline measured in the
same run.

    python scripts/bench_attention_dropout.py --length 8192 --heads 4 --head-dim 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_attention import measure, return_freed_memory_at_once  # noqa: E402

from mindspeed_flow.attention import varlen_attention  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=8192, help="tokens of the one segment")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--causal", action="store_true", help="causal segment (default: full, as in a ViT)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    return_freed_memory_at_once()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.length, args.heads, args.head_dim, generator=gen).requires_grad_(True)
               for _ in range(3))
    cu = [0, args.length]

    def whole_segment() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             dropout_p=args.dropout, is_causal=args.causal)
        out.sum().backward()
        return out

    def blocked() -> torch.Tensor:
        out = varlen_attention(q, k, v, cu, cu, args.causal, dropout_p=args.dropout)
        out.sum().backward()
        return out

    rows = []
    for name, fn in (("SDPA, whole segment (baseline)", whole_segment), ("varlen_attention", blocked)):
        seconds, peak_mb, _ = measure(fn, args.repeats, torch.device("cpu"))
        q.grad = k.grad = v.grad = None
        rows.append((name, seconds, peak_mb))
        print(f"{name:32s} {seconds:8.2f} s {peak_mb:9.0f} MB", flush=True)
    (_, base_s, base_mb), (_, ours_s, ours_mb) = rows
    print(f"one {'causal' if args.causal else 'full'} segment of {args.length} tokens, {args.heads} heads x "
          f"{args.head_dim}, dropout {args.dropout}, fp32, forward+backward: memory x{ours_mb / base_mb:.3f} "
          f"({ours_mb - base_mb:+.0f} MB), time x{ours_s / base_s:.2f} against the baseline")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
