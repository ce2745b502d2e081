"""Varlen attention on CUDA through flash-attn's ``flash_attn_varlen_func``.

Written against flash-attn 2's documented signature ``flash_attn_varlen_func(q, k, v,
cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
window_size=(-1, -1), ...)``: TND tensors, int32 offsets with the leading zero, bottom-right
aligned causal masking and ``(left, right)`` windows, the same conventions as
:func:`mindspeed_flow.attention.varlen_attention`.  ``flash_varlen_args`` is the pure
translation (tested on CPU); ``flash_varlen`` is registered as the ``"flash_attn"`` backend
for CUDA tensors when this module is imported, and imports ``flash_attn`` only when called.
Without flash-attn, and for fp32 inputs (flash-attn takes fp16 and bf16 only), CUDA
tensors fall back to SDPA per segment.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import re
from typing import Any, Optional

import torch

from mindspeed_flow.attention.backends import VarlenBackend, register_backend, require_runnable
from mindspeed_flow.attention.segments import Window, lengths

# ``window_size`` (sliding windows) and bottom-right causal alignment came with 2.3 / 2.1.
MIN_FLASH_ATTN = (2, 3)


def flash_varlen_args(
    offsets_q: list[int],
    offsets_k: list[int],
    causal: bool,
    scale: float,
    window: Window,
    dropout_p: float,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Keyword arguments of ``flash_attn_varlen_func`` for one pack."""
    left, right = window
    return {
        "cu_seqlens_q": torch.tensor(offsets_q, dtype=torch.int32, device=device),
        "cu_seqlens_k": torch.tensor(offsets_k, dtype=torch.int32, device=device),
        "max_seqlen_q": max(lengths(offsets_q), default=0),
        "max_seqlen_k": max(lengths(offsets_k), default=0),
        "dropout_p": dropout_p,
        "softmax_scale": scale,
        # causal is already folded into ``right``; flash-attn treats (-1, 0) as causal
        "causal": causal,
        "window_size": (left, right),
    }


def missing() -> Optional[str]:
    """Why the flash-attn kernel cannot run here, or None."""
    if importlib.util.find_spec("flash_attn") is None:
        return "flash-attn is not installed"
    version = importlib.metadata.version("flash-attn")
    release = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
    if release < MIN_FLASH_ATTN:
        return f"flash-attn {version} is older than {'.'.join(map(str, MIN_FLASH_ATTN))} (no window_size)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def flash_varlen(
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
    """Run ``flash_attn_varlen_func``; returns ``[Tq, Hq, Dv]``."""
    require_runnable("flash-attn varlen attention", missing(), q.device, "cuda")
    flash_attn = importlib.import_module("flash_attn")
    args = flash_varlen_args(offsets_q, offsets_k, causal, scale, window, dropout_p, q.device)
    return flash_attn.flash_attn_varlen_func(q, k, v, **args)


register_backend(
    VarlenBackend(name="flash_attn", device_types=("cuda",), fn=flash_varlen, missing=missing,
                  dtypes=(torch.float16, torch.bfloat16))
)
