"""The one varlen attention entry point, from ``cu_seqlens``.

Packed sequences and native-resolution images attend only within their own segment.  A
dense ``S x S`` mask expresses that at quadratic memory in the pack length; passing the
segment boundaries to a varlen kernel expresses it at none.  This module validates the
inputs once, normalises the boundary conventions, and hands them to the backend chosen for
the tensors' device (see :mod:`.backends`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .backends import VarlenBackend, register_backend, select_backend
from .sdpa import sdpa_varlen
from .segments import CuSeqlens, Window, normalize_window, offsets

register_backend(VarlenBackend(name="sdpa", device_types=("*",), fn=sdpa_varlen))


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: CuSeqlens,
    cu_seqlens_k: CuSeqlens,
    causal: bool,
    softmax_scale: Optional[float] = None,
    window: Optional[Window] = None,
    *,
    dropout_p: float = 0.0,
    backend: Optional[str] = None,
) -> torch.Tensor:
    """Attention of every segment of a pack with itself only, in TND layout.

    Args:
        q: ``[Tq, Hq, D]``; k: ``[Tk, Hk, D]`` and v: ``[Tk, Hk, Dv]`` with ``Hq % Hk == 0``
            (grouped-query attention is native in every backend).
        cu_seqlens_q, cu_seqlens_k: segment ends, with a leading 0 (Megatron, flash-attn)
            or without (torch_npu, MindSpeed-MM's ViT); a tensor or a list; they must
            cover all ``Tq`` / ``Tk`` tokens and hold the same number of segments.
        causal: lower-triangular inside each segment (aligned bottom-right when a
            segment's query part is shorter than its key part).
        softmax_scale: defaults to ``1/sqrt(D)``.
        window: ``(left, right)`` sliding window, ``-1`` = unbounded (flash-attn's
            ``window_size``).  Qwen2.5-VL's windowed ViT layers need no window here: their
            windows are segments of ``cu_window_seqlens``.
        dropout_p: attention dropout; pass 0 outside training.  On CPU it runs one query
            block at a time under checkpointing (see :mod:`.sdpa`), never on whole-segment
            scores.
        backend: force ``"sdpa"``, ``"npu"`` or ``"flash_attn"``; default: by device.

    Returns:
        ``[Tq, Hq, Dv]``; a query row that can see no key is 0; an empty pack
        (``cu_seqlens=[0]``, no tokens) gives an empty result.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"varlen_attention takes TND tensors [tokens, heads, dim]; got q{tuple(q.shape)} "
            f"k{tuple(k.shape)} v{tuple(v.shape)}"
        )
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q{tuple(q.shape)}, k{tuple(k.shape)}, v{tuple(v.shape)} do not fit together")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of key/value heads ({k.shape[1]})")
    offs_q = offsets(cu_seqlens_q, q.shape[0])
    offs_k = offsets(cu_seqlens_k, k.shape[0])
    if len(offs_q) != len(offs_k):
        raise ValueError(
            f"cu_seqlens_q has {len(offs_q) - 1} segments but cu_seqlens_k has {len(offs_k) - 1}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if q.shape[0] == 0 or k.shape[0] == 0:
        return _no_attention(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    chosen = select_backend(q.device.type, backend, q.dtype)
    return chosen.fn(q, k, v, offs_q, offs_k, causal, scale, normalize_window(window, causal), dropout_p)


def _no_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The result when there are no queries or no keys (an empty pack): ``[Tq, Hq, Dv]`` of
    zeros, decided here rather than by a kernel (``torch.cat`` of no segments raises; the
    device kernels' behaviour on T = 0 is undocumented).  Kept in the autograd graph so a
    backward through an empty pack gives zero gradients instead of failing."""
    anchor = q.sum() * 0 + k.sum() * 0 + v.sum() * 0
    return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1]) + anchor
