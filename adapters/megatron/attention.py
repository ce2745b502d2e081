"""Megatron's ``DotProductAttention.forward`` with packed sequences, through varlen attention.

Megatron's local ``DotProductAttention`` refuses ``packed_seq_params`` (only
TransformerEngine handles THD), and MindSpeed's fused replacement needs an NPU.  The
wrapper here serves packed calls from ``varlen_attention`` on any device (NPU kernel,
flash-attn or SDPA per segment) and passes every other call through untouched, so the
dense path keeps its upstream behaviour.

Contract of the call it serves (megatron-core 0.12 to 0.16): ``Attention.forward`` has
squeezed the batch dimension, so ``query`` is ``[T, Hq, D]`` and ``key`` / ``value`` are
``[T, Hkv, D]``; the result must reshape to ``[T, 1, Hq * D]``.  ``cu_seqlens_*`` may be
Megatron tensors (leading zero) or MindSpeed-MM's ViT lists (no leading zero).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from mindspeed_flow.attention import varlen_attention

from ..devices import flash_attn as _flash_attn  # noqa: F401  (registers the CUDA kernel)
from ..devices import torch_npu as _torch_npu  # noqa: F401  (registers the NPU kernel)

FORWARD_PARAMS = (
    "query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias", "packed_seq_params",
)
CAUSAL_MASK_TYPES = {"causal", "padding_causal", "causal_bottom_right"}
FULL_MASK_TYPES = {"padding", "no_mask"}


def _bound(args: tuple, kwargs: dict) -> dict[str, Any]:
    """The forward call's arguments by name (missing optional ones are None)."""
    named = dict(zip(FORWARD_PARAMS, args))
    named.update(kwargs)
    return {name: named.get(name) for name in FORWARD_PARAMS}


def is_causal(mask_type: Any) -> bool:
    """Map an ``AttnMaskType`` to causal / full; refuse masks that segments cannot express."""
    name = getattr(mask_type, "name", str(mask_type))
    if name in CAUSAL_MASK_TYPES:
        return True
    if name in FULL_MASK_TYPES:
        return False
    raise ValueError(
        f"fused_attn: attn_mask_type {name!r} with packed_seq_params cannot be expressed as "
        "segment boundaries; use causal, padding_causal, padding or no_mask"
    )


def _same_or_absent(padded: Any, actual: Any) -> bool:
    if padded is None:
        return True
    return [int(x) for x in padded] == [int(x) for x in actual]


def effective_softmax_scale(instance: Any) -> float:
    """Megatron splits the scale between ``softmax_scale`` and the fused softmax's ``scale``
    (query-key layer scaling); the product is what the scores are multiplied by."""
    coeff = getattr(getattr(instance, "scale_mask_softmax", None), "scale", None)
    return instance.softmax_scale * (coeff if coeff is not None else 1.0)


def _to_tnd(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() == 4:
        if x.shape[1] != 1:
            raise ValueError(
                f"fused_attn: packed sequences need batch size 1 (THD), got {name} of shape {tuple(x.shape)}"
            )
        return x.squeeze(1)
    return x


def _dropout_context(instance: Any, dropout_p: float) -> contextlib.AbstractContextManager:
    """Megatron draws attention dropout from the model-parallel RNG stream unless sequence
    parallelism is on; keep that so TP ranks drop different elements as upstream does."""
    if dropout_p == 0.0 or instance.config.sequence_parallel:
        return contextlib.nullcontext()
    from megatron.core import tensor_parallel

    return tensor_parallel.get_cuda_rng_tracker().fork()


def _refuse_what_varlen_ignores(instance: Any) -> None:
    """megatron-core 0.16's local ``DotProductAttention`` can also do sliding-window
    attention (``scale_mask_softmax.window_size``) and off-by-one / learnable softmax
    (``softmax_offset``); 0.12's has neither (it asserts ``window_size is None``). Varlen
    attention does neither, so refuse rather than silently compute something else."""
    window = getattr(getattr(instance, "scale_mask_softmax", None), "window_size", None)
    if window is not None:
        raise ValueError(
            f"fused_attn: sliding-window attention (window_size={window}) is not supported "
            "with packed_seq_params"
        )
    if getattr(instance, "softmax_offset", None) is not None:
        raise ValueError(
            f"fused_attn: softmax_type={instance.config.softmax_type!r} (softmax offset) is not "
            "supported with packed_seq_params; use 'vanilla'"
        )


def dot_product_attention_forward(
    wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict
) -> Any:
    """wrapt wrapper of ``DotProductAttention.forward``: varlen when ``packed_seq_params``."""
    call = _bound(args, kwargs)
    packed = call["packed_seq_params"]
    if packed is None:
        return wrapped(*args, **kwargs)
    if call["attention_bias"] is not None:
        raise ValueError("fused_attn: attention_bias is not supported with packed_seq_params")
    if getattr(packed, "qkv_format", None) not in (None, "thd"):
        raise ValueError(f"fused_attn: packed_seq_params.qkv_format must be 'thd', got {packed.qkv_format!r}")
    if not (_same_or_absent(packed.cu_seqlens_q_padded, packed.cu_seqlens_q)
            and _same_or_absent(packed.cu_seqlens_kv_padded, packed.cu_seqlens_kv)):
        raise ValueError(
            "fused_attn: cu_seqlens_*_padded differ from cu_seqlens_* (context-parallel padding); "
            "padded packs are not supported by the varlen patch"
        )
    if getattr(packed, "local_cp_size", None) not in (None, 1):
        # megatron-core 0.16 adds per-batch (dynamic) context parallelism to PackedSeqParams
        raise ValueError(
            f"fused_attn: packed_seq_params.local_cp_size={packed.local_cp_size}; context "
            "parallelism is not supported by the varlen patch"
        )
    _refuse_what_varlen_ignores(instance)
    mask_type = call["attn_mask_type"] if call["attn_mask_type"] is not None else instance.attn_mask_type
    query = _to_tnd(call["query"], "query")
    dropout_p = instance.attention_dropout.p if instance.training else 0.0
    with _dropout_context(instance, dropout_p):
        out = varlen_attention(
            query,
            _to_tnd(call["key"], "key"),
            _to_tnd(call["value"], "value"),
            packed.cu_seqlens_q,
            packed.cu_seqlens_kv,
            causal=is_causal(mask_type),
            softmax_scale=effective_softmax_scale(instance),
            dropout_p=dropout_p,
        )
    return out.reshape(out.shape[0], 1, -1)
