"""Varlen attention (no dense S x S masks) and the Conv->Matmul patch embedding.

The core of the ``fused_attn`` and ``conv_matmul`` features; imports only torch.  The
patches that put these in place of upstream code are in ``mindspeed_flow.patches``, the
upstream-facing wrappers and the device kernels in ``mindspeed_flow.adapters``.
"""

from .backends import VarlenBackend, register_backend, select_backend
from .segments import actual_seq_lens, normalize_window, offsets
from .varlen import varlen_attention

__all__ = [
    "VarlenBackend",
    "actual_seq_lens",
    "normalize_window",
    "offsets",
    "register_backend",
    "select_backend",
    "varlen_attention",
]
