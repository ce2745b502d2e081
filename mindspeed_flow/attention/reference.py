"""The dense-mask formulation that varlen attention replaces: a baseline, never a code path.

Upstream expresses "attend within your segment" as a dense ``[S, S]`` boolean mask (the
ViT's block mask, the LLM's causal+padding mask).  Tests check the varlen backends
against it and ``scripts/bench_attention.py`` measures what it costs; nothing in the
patches calls it.
"""

from __future__ import annotations

from typing import Optional

import torch

from .segments import CuSeqlens, Window, normalize_window, offsets


def segment_mask(
    cu_seqlens_q: CuSeqlens,
    cu_seqlens_k: CuSeqlens,
    total_q: int,
    total_k: int,
    causal: bool,
    window: Optional[Window] = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """``[Tq, Tk]`` bool, True where query may attend key (same semantics as varlen)."""
    offs_q, offs_k = offsets(cu_seqlens_q, total_q), offsets(cu_seqlens_k, total_k)
    left, right = normalize_window(window, causal)
    seg_q, seg_k = _segment_ids(offs_q, device), _segment_ids(offs_k, device)
    starts_q, lens_q = _starts_and_lengths(offs_q, device)
    starts_k, lens_k = _starts_and_lengths(offs_k, device)
    # positions inside the segment, queries aligned bottom-right against the keys
    pos_q = torch.arange(total_q, device=device) - starts_q[seg_q] + (lens_k - lens_q)[seg_q]
    pos_k = torch.arange(total_k, device=device) - starts_k[seg_k]
    allowed = seg_q[:, None] == seg_k[None, :]
    if left != -1:
        allowed &= pos_k[None, :] >= pos_q[:, None] - left
    if right != -1:
        allowed &= pos_k[None, :] <= pos_q[:, None] + right
    return allowed


def _starts_and_lengths(offs: list[int], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.tensor(offs[:-1], device=device, dtype=torch.long)
    return starts, torch.tensor(offs[1:], device=device, dtype=torch.long) - starts


def _segment_ids(offs: list[int], device: torch.device | str) -> torch.Tensor:
    _, lens = _starts_and_lengths(offs, device)
    return torch.repeat_interleave(torch.arange(len(lens), device=device), lens)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """Textbook masked softmax attention in TND layout, in the inputs' dtype.

    Rows with no allowed key are 0, matching the varlen kernels.
    """
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v)
