"""Portable varlen attention: PyTorch SDPA over the segments of a pack.

Segments of equal (query, key) length are gathered into one batch, so a pack of many
same-sized pieces (Qwen2.5-VL windows, video frames) costs one SDPA call, not one per
piece.  No mask spanning the pack is built: plain causal segments use SDPA's
``is_causal`` (the CPU flash kernel, which materialises nothing), and a mask is built only
for a sliding window or unequal query/key lengths, one query block at a time
(``BLOCK`` rows by the keys that block can reach), so its size is bounded by the block and
the window, never by the pack.

FlexAttention was not used: without ``torch.compile`` (no compiler on the target hosts)
it falls back to a reference path that materialises the full score matrix.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F

from .segments import Window, lengths

# Query rows per block when a mask is needed; the mask is BLOCK x (BLOCK + window) bools.
BLOCK = 1024


def sdpa_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offsets_q: list[int],
    offsets_k: list[int],
    causal: bool,
    scale: float,
    window: Window,
    dropout_p: float,
) -> torch.Tensor:
    """TND in, TND out; see :func:`mindspeed_flow.attention.varlen_attention`."""
    groups: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for start_q, start_k, lq, lk in zip(offsets_q, offsets_k, lengths(offsets_q), lengths(offsets_k)):
        if lq:
            groups[(lq, lk)].append((start_q, start_k))

    pieces, rows = [], []
    for (lq, lk), starts in groups.items():
        start_q = torch.tensor([s for s, _ in starts], device=q.device)
        start_k = torch.tensor([s for _, s in starts], device=q.device)
        idx_q = (start_q[:, None] + torch.arange(lq, device=q.device)).flatten()
        idx_k = (start_k[:, None] + torch.arange(lk, device=q.device)).flatten()
        n = len(starts)
        qg = q[idx_q].view(n, lq, *q.shape[1:]).transpose(1, 2)
        kg = k[idx_k].view(n, lk, *k.shape[1:]).transpose(1, 2)
        vg = v[idx_k].view(n, lk, *v.shape[1:]).transpose(1, 2)
        out = _attend(qg, kg, vg, causal, scale, window, dropout_p)  # [n, H, lq, Dv]
        pieces.append(out.transpose(1, 2).reshape(n * lq, *out.shape[1:2], out.shape[-1]))
        rows.append(idx_q)

    if not pieces:  # an empty pack
        return q.new_zeros(0, q.shape[1], v.shape[-1])
    # The offsets cover every query row exactly once, so sorting the gathered rows by
    # their position restores the pack order.
    return torch.cat(pieces)[torch.argsort(torch.cat(rows))]


def _attend(q, k, v, causal: bool, scale: float, window: Window, dropout_p: float) -> torch.Tensor:
    """[n, H, lq, D] x [n, Hk, lk, D] -> [n, H, lq, Dv] for one group of equal-length segments."""
    lq, lk = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if lk == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    left, right = window
    if left == -1 and right == -1:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    if left == -1 and right == 0 and lq == lk:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa
        )
    blocks = [_attend_block(q, k, v, r0, min(r0 + BLOCK, lq), window, scale, dropout_p, gqa)
              for r0 in range(0, lq, BLOCK)]
    return torch.cat(blocks, dim=-2)


def _attend_block(q, k, v, r0: int, r1: int, window: Window, scale: float, dropout_p: float, gqa: bool):
    """Query rows ``r0:r1`` against only the keys their window can reach."""
    lq, lk = q.shape[-2], k.shape[-2]
    shift = lk - lq  # bottom-right alignment: query i sits at key position i + shift
    left, right = window
    lo = 0 if left == -1 else max(0, r0 + shift - left)
    hi = lk if right == -1 else min(lk, r1 - 1 + shift + right + 1)
    rows = r1 - r0
    if hi <= lo:
        return q.new_zeros(*q.shape[:2], rows, v.shape[-1])
    pos_q = torch.arange(r0, r1, device=q.device)[:, None] + shift
    pos_k = torch.arange(lo, hi, device=q.device)[None, :]
    allowed = torch.ones(rows, hi - lo, dtype=torch.bool, device=q.device)
    if left != -1:
        allowed &= pos_k >= pos_q - left
    if right != -1:
        allowed &= pos_k <= pos_q + right
    # A row that sees no key gets output 0 (as flash-attn and the NPU kernel give); it is
    # let see every key inside SDPA so softmax stays finite, then zeroed.
    empty = ~allowed.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(
        q[..., r0:r1, :], k[..., lo:hi, :], v[..., lo:hi, :],
        attn_mask=allowed | empty, dropout_p=dropout_p, scale=scale, enable_gqa=gqa,
    )
    return out.masked_fill(empty, 0.0) if bool(empty.any()) else out
