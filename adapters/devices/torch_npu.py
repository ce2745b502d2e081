"""Varlen attention on Ascend NPUs through ``torch_npu.npu_fusion_attention`` (TND layout).

Written against the documented API (torch_npu 6.0 "npu_fusion_attention"): ``input_layout
="TND"`` needs ``actual_seq_qlen`` / ``actual_seq_kvlen`` as cumulative segment ends
without a leading zero (lengths 2, 2, 2 -> ``[2, 4, 6]``); causal attention inside each
segment is ``sparse_mode=3`` (rightDownCausal) with the compressed 2048 x 2048
upper-triangular mask; a sliding window is ``sparse_mode=4`` (band) with ``pre_tockens`` /
``next_tockens`` and the same compressed mask; full attention inside segments is
``sparse_mode=0`` with no mask.  So no mask of the pack's size is ever built.

``npu_fusion_attention_args`` is the pure translation (tested on CPU); ``npu_varlen``
runs it and is registered as the ``"npu"`` backend when this module is imported.  It
could not be run here (no NPU); ``torch_npu`` is imported only when it is called.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Optional

import torch

from mindspeed_flow.attention.backends import VarlenBackend, register_backend, require_runnable
from mindspeed_flow.attention.segments import Window, actual_seq_lens

# Side of the compressed causal / band mask the kernel expects for sparse modes 2, 3, 4.
COMPRESSED_MASK_SIZE = 2048
# The kernel's "unbounded" pre/next token count (its default).
UNBOUNDED = 2147483647

_MASKS: dict[torch.device, torch.Tensor] = {}


def npu_fusion_attention_args(
    offsets_q: list[int],
    offsets_k: list[int],
    num_heads: int,
    scale: float,
    window: Window,
    dropout_p: float,
) -> dict[str, Any]:
    """Keyword arguments of ``npu_fusion_attention`` for one pack, mask left symbolic.

    ``atten_mask`` is ``"compressed"`` where the kernel needs its 2048 x 2048
    upper-triangular mask, else ``None``; :func:`npu_varlen` puts the tensor in.
    ``window`` is already normalised: causal is ``right == 0``, so the mode follows from it.
    """
    left, right = window
    args: dict[str, Any] = {
        "head_num": num_heads,
        "input_layout": "TND",
        "scale": scale,
        "keep_prob": 1.0 - dropout_p,
        "actual_seq_qlen": actual_seq_lens(offsets_q),
        "actual_seq_kvlen": actual_seq_lens(offsets_k),
        "pre_tockens": UNBOUNDED,
        "next_tockens": UNBOUNDED,
        "sparse_mode": 0,
        "atten_mask": None,
    }
    if left == -1 and right == -1:
        return args
    if left == -1 and right == 0:
        args.update(sparse_mode=3, atten_mask="compressed", next_tockens=0)
        return args
    args.update(
        sparse_mode=4,
        atten_mask="compressed",
        pre_tockens=UNBOUNDED if left == -1 else left,
        next_tockens=UNBOUNDED if right == -1 else right,
    )
    return args


def compressed_mask(device: torch.device) -> torch.Tensor:
    """The kernel's 2048 x 2048 mask (True = masked, above the diagonal), one per device."""
    if device not in _MASKS:
        ones = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=device)
        _MASKS[device] = torch.triu(ones, diagonal=1)
    return _MASKS[device]


def missing() -> Optional[str]:
    """Why the NPU kernel cannot run here, or None."""
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed (the NPU backend needs an Ascend host with torch_npu)"
    return None


def npu_varlen(
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
    """Run ``npu_fusion_attention`` in TND layout; returns ``[Tq, Hq, Dv]``."""
    require_runnable("NPU varlen attention", missing(), q.device, "npu")
    torch_npu = importlib.import_module("torch_npu")
    args = npu_fusion_attention_args(offsets_q, offsets_k, q.shape[1], scale, window, dropout_p)
    if args["atten_mask"] == "compressed":
        args["atten_mask"] = compressed_mask(q.device)
    return torch_npu.npu_fusion_attention(q, k, v, **args)[0]


register_backend(VarlenBackend(name="npu", device_types=("npu",), fn=npu_varlen, missing=missing))
