"""MindSpeed-MM wrappers of the ``fused_attn`` and ``conv_matmul`` features.

What upstream does with a packed batch (read from MindSpeed-MM 57069cd):

* ``VLMModel.forward`` accepts ``packed_seq_params`` but does not pass it to the text
  decoder, and always asks ``prepare_positionsids_mask_for_llm`` for a mask: a dense
  ``[B, 1, S, S]`` causal+padding mask (CP = 1).
* ``Qwen2VLViT.forward`` and ``Qwen2VLVisionTransformerBlock.forward`` read
  ``get_args().use_flash_attn``: when False they build a dense ``[1, S, S]`` block mask
  (and a window mask) in a Python loop and drop ``cu_seqlens``; when True they hand
  ``cu_seqlens`` / ``cu_window_seqlens`` to the attention as ``PackedSeqParams``.
* ``Qwen2vlSelfAttention.forward`` (the LLM attention) squeezes the batch dimension of a
  packed query before applying M-RoPE, whose ``cos``/``sin`` keep it: the shapes no longer
  broadcast.

The wrappers here make a packed batch flow without any dense mask: the loader's
``cu_seqlens`` become ``PackedSeqParams`` that reach the decoder, the LLM mask builder
returns no mask for it, the ViT modules see ``use_flash_attn`` as True (their packed path),
and M-RoPE is applied on the unsqueezed query.  Attention itself is then served by the
``DotProductAttention`` patch (:mod:`..megatron.attention`).  Nothing upstream is
imported at module level.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable, Optional, Sequence

import torch

from mindspeed_flow.attention.patch_embed import matmul_forward_for_conv, replace_conv
from mindspeed_flow.attention.segments import lengths, offsets

# packed_seq_params of the VLMModel.forward call in progress (None outside a packed call).
_PACKED: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("flow_packed_seq_params", default=None)

VLM_FORWARD_PARAMS = (
    "input_ids", "pixel_values", "image_grid_thw", "attention_mask", "labels", "inference_params",
    "decoder_input", "position_ids", "packed_seq_params",
)
GPT_FORWARD_PARAMS = (
    "input_ids", "position_ids", "attention_mask", "decoder_input", "labels", "inference_params",
    "packed_seq_params",
)
MASK_BUILDER_PARAMS = ("config", "input_ids", "inference_params", "attention_mask", "position_ids")
ROPE_PARAMS = ("q", "k", "cos", "sin", "use_fused_rope")
LOADER_CU_SEQLENS_KEY = "cu_seqlens"


def _argument(args: tuple, kwargs: dict, names: Sequence[str], name: str) -> Any:
    position = names.index(name)
    return args[position] if position < len(args) else kwargs.get(name)


def _with_argument(args: tuple, kwargs: dict, names: Sequence[str], name: str, value: Any):
    """``(args, kwargs)`` with ``name`` set, positionally if it was passed positionally."""
    position = names.index(name)
    if position < len(args):
        return args[:position] + (value,) + args[position + 1:], kwargs
    return args, {**kwargs, name: value}


def packed_seq_params(cu_seqlens: Any) -> Any:
    """Megatron ``PackedSeqParams`` (THD) for a pack whose segments end at ``cu_seqlens``."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.as_tensor(cu_seqlens).flatten()
    offs = offsets(cu, int(cu[-1]))
    cu = torch.tensor(offs, dtype=torch.int32, device=cu.device)
    longest = max(lengths(offs), default=0)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest
    )


def vlm_forward(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``VLMModel.forward``: a packed batch keeps its segments down to the text decoder.

    The packing loader's batch carries ``cu_seqlens`` (popped here: upstream does not know
    the key); an explicit ``packed_seq_params`` wins.  For the duration of the call the
    params are visible to the mask-builder and ``MMGPTModel.forward`` wrappers.
    """
    kwargs = dict(kwargs)
    cu_seqlens = kwargs.pop(LOADER_CU_SEQLENS_KEY, None)
    packed = _argument(args, kwargs, VLM_FORWARD_PARAMS, "packed_seq_params")
    if packed is None and cu_seqlens is not None:
        packed = packed_seq_params(cu_seqlens)
        args, kwargs = _with_argument(args, kwargs, VLM_FORWARD_PARAMS, "packed_seq_params", packed)
    if packed is None:
        return wrapped(*args, **kwargs)
    token = _PACKED.set(packed)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _PACKED.reset(token)


def mm_gpt_forward(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``MMGPTModel.forward``: receive the packed params ``VLMModel.forward`` does not pass on."""
    packed = _PACKED.get()
    if packed is not None and _argument(args, kwargs, GPT_FORWARD_PARAMS, "packed_seq_params") is None:
        args, kwargs = _with_argument(args, kwargs, GPT_FORWARD_PARAMS, "packed_seq_params", packed)
    return wrapped(*args, **kwargs)


def no_global_mask_when_packed(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """MindSpeed's ``get_attention_mask(config)``, as its mask generator (``GenerateMaskFeature``,
    the wrapper on ``DotProductAttention.forward`` without ``--use-flash-attn``) calls it for a
    causal call that has no mask: ``None`` during a packed ``VLMModel.forward``.

    A packed call has no mask on purpose (the varlen path under it needs none); building
    MindSpeed's global ``[S, S]`` mask for it would fail on MindSpeed-MM's model config
    (``'ConfigReader' object has no attribute 'transformer_impl'``).  The wrapper sits on the
    module global the generator looks up at call time, not on the generator itself, so
    ``remove()`` leaves ``DotProductAttention.forward``'s chain exactly as MindSpeed built it.
    """
    if _PACKED.get() is not None:
        return None
    return wrapped(*args, **kwargs)


def prepare_mask_for_llm(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``prepare_positionsids_mask_for_llm``: no dense mask for a packed batch.

    Returns ``(None, position_ids)``; the segments travel in ``packed_seq_params``.  The
    per-sample position ids (M-RoPE ``[3, 1, T]`` for Qwen2-VL) must come with the batch,
    since the upstream builder computes them for unpacked rows only.
    """
    if _PACKED.get() is None:
        return wrapped(*args, **kwargs)
    position_ids = _argument(args, kwargs, MASK_BUILDER_PARAMS, "position_ids")
    if position_ids is None:
        raise ValueError(
            "fused_attn: a packed batch (cu_seqlens / packed_seq_params) must carry position_ids "
            "that restart for every sample (M-RoPE [3, 1, T] for Qwen2-VL); upstream's builder "
            "computes them only for unpacked rows"
        )
    return None, position_ids


class FlashArgsView:
    """Megatron's global args, read with ``use_flash_attn`` True; every other attribute,
    read or written, is the real one."""

    __slots__ = ("_args",)

    def __init__(self, args: Any) -> None:
        object.__setattr__(self, "_args", args)

    def __getattr__(self, name: str) -> Any:
        if name == "use_flash_attn":
            return True
        return getattr(self._args, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._args, name, value)


def vit_get_args(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``get_args`` as seen by the Qwen2-VL ViT modules: their packed (varlen) path.

    Wrapped per module (never rebinding other modules' ``get_args``), so only the ViT's
    mask decisions change; it stays in effect during activation recomputation, which
    re-reads ``get_args()`` in the backward pass.
    """
    return FlashArgsView(wrapped(*args, **kwargs))


def mrope_on_packed(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``apply_multimodal_rotary_pos_emb(q, k, cos, sin, ...)`` for a squeezed THD query.

    ``q``/``k`` are ``[T, H, D]`` in a packed call while ``cos``/``sin`` stay ``[T, 1, 1, D]``;
    apply on ``[T, 1, H, D]`` and squeeze back.  Unpacked calls pass through.
    """
    q, k, cos = (_argument(args, kwargs, ROPE_PARAMS, name) for name in ("q", "k", "cos"))
    if q is None or cos is None or q.dim() != 3 or cos.dim() != 4:
        return wrapped(*args, **kwargs)
    args, kwargs = _with_argument(args, kwargs, ROPE_PARAMS, "q", q.unsqueeze(1))
    args, kwargs = _with_argument(args, kwargs, ROPE_PARAMS, "k", k.unsqueeze(1))
    q_embed, k_embed = wrapped(*args, **kwargs)
    return q_embed.squeeze(1), k_embed.squeeze(1)


def swap_conv_after_init(attribute: str, *, keep_conv_type: bool = False) -> Callable[..., Any]:
    """A wrapper of ``__init__`` that replaces ``self.<attribute>`` (a stride == kernel
    conv) by :class:`~mindspeed_flow.attention.patch_embed.PatchEmbedMatmul`.

    The replacement keeps the conv's parameters in the conv's shape, at the same place in
    the module tree (same names, same registration order), so Megatron's checkpoints
    (``torch`` and ``torch_dist``, model and optimizer, distributed optimizer's flat
    buffers included) are the same with and without the flag: nothing here touches them.

    ``keep_conv_type``: the conv (a Conv3d) stays the same module and only gets the matmul
    forward (:class:`~mindspeed_flow.attention.patch_embed.MatmulConv3d`), for Hugging Face
    models. Their ``post_init`` / ``init_weights`` run after this ``__init__`` and initialise
    modules by ``isinstance(module, nn.Conv3d)``: the conv's weights copied into a
    ``PatchEmbedMatmul`` here would be skipped there, keeping torch's default init (or
    ``to_empty``'s uninitialised memory) and shifting the random numbers of every later module."""
    swap = matmul_forward_for_conv if keep_conv_type else replace_conv

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        swap(instance, attribute)
        return result

    wrapper.__name__ = f"swap_{attribute}_for_matmul"
    return wrapper
