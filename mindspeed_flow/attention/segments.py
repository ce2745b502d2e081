"""Segment boundaries of packed sequences, in the conventions each kernel wants.

Packed (THD / TND) attention describes a pack of ``T`` tokens by the offsets where each
segment starts.  Two conventions meet in the upstream code this plugin patches:

* Megatron, TransformerEngine and flash-attn: ``cu_seqlens = [0, e1, e2, ..., T]``
  (a leading zero, ``n + 1`` entries, an int32 tensor);
* ``torch_npu.npu_fusion_attention``, and MindSpeed-MM's ViT, which hands its
  ``cu_seqlens[1:]`` list straight to that kernel: ``[e1, e2, ..., T]`` (no leading zero).

Everything here works on plain Python lists of ints so that every backend's argument
translation is a pure function, testable without the kernel.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

CuSeqlens = Union[torch.Tensor, Sequence[int]]
Window = tuple[int, int]


def _as_int_list(cu: CuSeqlens) -> list[int]:
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu.shape)}")
        if cu.is_floating_point():
            raise ValueError(f"cu_seqlens must hold integers, got dtype {cu.dtype}")
        return [int(x) for x in cu.tolist()]
    return [int(x) for x in cu]


def offsets(cu: CuSeqlens, total: int) -> list[int]:
    """``[0, e1, ..., total]`` from either convention, checked against the token count.

    A missing leading zero is added, so MindSpeed-MM's ``cu_seqlens[1:]`` lists and
    Megatron's tensors are both accepted.  The ends must be non-decreasing and the last
    one must equal ``total``: a pack whose segments do not cover every token would leave
    rows of the output undefined, which is refused rather than guessed.
    """
    ends = _as_int_list(cu)
    if not ends:
        raise ValueError("cu_seqlens is empty")
    if ends[0] != 0:
        ends = [0] + ends
    for a, b in zip(ends, ends[1:]):
        if b < a:
            raise ValueError(f"cu_seqlens must be non-decreasing, got {ends}")
    if ends[-1] != total:
        raise ValueError(
            f"cu_seqlens ends at {ends[-1]} but the packed tensor holds {total} tokens; "
            "the segments must cover the whole pack"
        )
    return ends


def lengths(offs: Sequence[int]) -> list[int]:
    """Segment lengths from ``[0, e1, ..., T]`` offsets."""
    return [b - a for a, b in zip(offs, offs[1:])]


def actual_seq_lens(offs: Sequence[int]) -> list[int]:
    """The NPU form: cumulative ends without the leading zero (``[2, 4, 6]`` for 2, 2, 2)."""
    return list(offs[1:])


def normalize_window(window: Window | None, causal: bool) -> Window:
    """``(left, right)`` in flash-attn's convention; ``-1`` means unbounded.

    Query ``i`` of a segment (aligned to the bottom right when the query part is shorter
    than the key part) may see keys ``i - left .. i + right``; ``causal`` caps ``right``
    at 0.  ``None`` is ``(-1, -1)``.
    """
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if left < -1 or right < -1:
        raise ValueError(f"window entries must be >= -1 (-1 = unbounded), got {window}")
    if causal:
        right = 0 if right == -1 else min(right, 0)
    return left, right
