"""Portable varlen attention: PyTorch SDPA over the segments of a pack.

Segments of equal (query, key) length are stacked into one batch, so a pack of many
same-sized pieces (Qwen2.5-VL windows, video frames) costs one SDPA call, not one per
piece.  No mask spanning the pack is built: plain causal segments use SDPA's
``is_causal`` (the CPU flash kernel, which materialises nothing), and a mask is built only
for a sliding window or unequal query/key lengths, one query block at a time
(``BLOCK`` rows by the keys that block can reach), so its size is bounded by the block and
the window (by the segment when the window is unbounded on one side), never by the pack;
``tests/attention/test_varlen.py`` checks that no op returns a tensor of ``[T, T]`` size.

Dropout: PyTorch's CPU flash kernel has no dropout, so SDPA with ``dropout_p > 0`` on CPU
falls back to its math kernel, which materialises the ``[n, H, L, L]`` scores of a whole
segment (4 heads x one 8k segment, forward+backward: 4.1 GB, see
scripts/bench_attention_dropout.py).  On CPU a dropout call therefore goes one
query block at a time, each block under activation checkpointing (the RNG state is
replayed, so the recomputed dropout mask is the same): forward and backward hold the
scores of one ``BLOCK x L`` block, never of the segment.  Devices with a fused dropout
kernel (CUDA) call SDPA on the whole segment.

FlexAttention was not used: without ``torch.compile`` (no compiler on the target hosts)
it runs an eager reference path that materialises the scores; measured here (torch 2.13,
4 heads x 4096 tokens, document-causal block mask) it took 5.4 s and 919 MB where this
backend takes well under a second and a few MB.
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
    """TND in, TND out; see :func:`mindspeed_flow.attention.varlen_attention`.

    Segments are split off as views and joined back with ``cat``, whose backward passes
    are a ``cat`` and a ``split``: no pack-sized zero gradient per segment, as indexing
    the pack would allocate.
    """
    lens_q, lens_k = lengths(offsets_q), lengths(offsets_k)
    parts_q, parts_k, parts_v = q.split(lens_q), k.split(lens_k), v.split(lens_k)
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for index, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        groups[(lq, lk)].append(index)

    outs: list[torch.Tensor] = [q.new_zeros(0, q.shape[1], v.shape[-1])] * len(lens_q)
    for (lq, _), members in groups.items():
        if lq == 0:
            continue
        out = _attend(
            _batch(parts_q, members), _batch(parts_k, members), _batch(parts_v, members),
            scale, window, dropout_p,
        ).transpose(1, 2)  # [n, lq, H, Dv]
        for row, index in enumerate(members):
            outs[index] = out[row]
    return torch.cat(outs)


def _batch(parts: tuple[torch.Tensor, ...], members: list[int]) -> torch.Tensor:
    """Segments of one length as a batch ``[n, H, L, D]`` (a view when there is one)."""
    batch = parts[members[0]][None] if len(members) == 1 else torch.stack([parts[i] for i in members])
    return batch.transpose(1, 2)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: Window, dropout_p: float
) -> torch.Tensor:
    """[n, H, lq, D] x [n, Hk, lk, D] -> [n, H, lq, Dv] for one group of equal-length segments.

    Causality arrives folded into ``window`` (``right == 0``), see ``normalize_window``.
    """
    lq, lk = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if lk == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    left, right = window
    if dropout_p > 0.0 and q.device.type == "cpu":
        return _attend_blocks_checkpointed(q, k, v, window, scale, dropout_p, gqa)
    if left == -1 and right == -1:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    if left == -1 and right == 0 and lq == lk:
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa
        )
    blocks = [_attend_block(q, k, v, r0, min(r0 + BLOCK, lq), window, scale, dropout_p, gqa)
              for r0 in range(0, lq, BLOCK)]
    return torch.cat(blocks, dim=-2)


def _attend_blocks_checkpointed(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: Window, scale: float, dropout_p: float, gqa: bool
) -> torch.Tensor:
    """Dropout on CPU: query blocks whose math-kernel scores are recomputed in backward
    (same RNG state, same dropout mask) instead of kept for the whole segment."""
    lq = q.shape[-2]
    blocks = [_RecomputedBlock.apply(q, k, v, r0, min(r0 + BLOCK, lq), window, scale, dropout_p, gqa)
              for r0 in range(0, lq, BLOCK)]
    return torch.cat(blocks, dim=-2)


class _RecomputedBlock(torch.autograd.Function):
    """One query block of :func:`_attend_block`, run without autograd in forward and again,
    from the CPU RNG state of the forward, in backward (activation checkpointing).

    Written out rather than ``torch.utils.checkpoint``: that one opens an autocast context
    for the device type it infers, which fails in processes where a PrivateUse1 backend
    without autocast support is registered (an NPU stand-in, for one).
    """

    @staticmethod
    def forward(ctx, q, k, v, r0, r1, window, scale, dropout_p, gqa):  # type: ignore[override]
        ctx.rng_state = torch.get_rng_state()
        ctx.block = (r0, r1, window, scale, dropout_p, gqa)
        ctx.save_for_backward(q, k, v)
        with torch.no_grad():
            return _attend_block(q, k, v, *ctx.block)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        inputs = [x.detach().requires_grad_(needed) for x, needed in zip(ctx.saved_tensors, ctx.needs_input_grad)]
        after_forward = torch.get_rng_state()
        torch.set_rng_state(ctx.rng_state)
        try:
            with torch.enable_grad():
                out = _attend_block(*inputs, *ctx.block)
        finally:
            torch.set_rng_state(after_forward)
        wanted = [x for x in inputs if x.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_out) if wanted else ())
        return (*(next(grads) if x.requires_grad else None for x in inputs), None, None, None, None, None, None)


def _attend_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, r0: int, r1: int, window: Window, scale: float,
    dropout_p: float, gqa: bool,
) -> torch.Tensor:
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
