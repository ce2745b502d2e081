"""Feature ``fused_attn`` (``--flow-fused-attn``): packed batches never build a dense mask.

Megatron's ``DotProductAttention`` serves ``packed_seq_params`` through varlen attention
(NPU kernel, flash-attn or SDPA per segment); MindSpeed-MM's VLM passes the loader's
segments down to the text decoder instead of building a ``[B, 1, S, S]`` mask, and its
Qwen2-VL and Qwen3-VL ViTs take their ``cu_seqlens`` (varlen) path instead of a
``[1, S, S]`` block mask; MindSpeed's mask generator (its default attention path, without
``--use-flash-attn``) leaves packed calls alone.

``--flow-packing`` turns this feature on (``mindspeed_flow.config``): without it a pack
would reach the attention as one sequence under one causal mask.
"""

from mindspeed_flow.adapters.megatron import attention as megatron_core_attention
from mindspeed_flow.adapters.mindspeed_mm import model as mindspeed_mm
from mindspeed_flow.patching import Patch
from mindspeed_flow.patching.versions import MEGATRON_CORE, MEGATRON_CORE_NEXT, MEGATRON_LM, MINDSPEED, MINDSPEED_MM, source

FEATURE = "fused_attn"
CHECKED_MEGATRON = (MEGATRON_CORE, source(MEGATRON_LM), source(MEGATRON_CORE_NEXT))
CHECKED_MM = (source(MINDSPEED_MM),)
VIT = "mindspeed_mm.models.vision.vision_encoders.qwen2vl_vit_model"
VIT_BLOCK = "mindspeed_mm.models.vision.vision_encoders.vision_transformer_block"
QWEN3_VIT = "mindspeed_mm.models.vision.vision_encoders.qwen3vl_vit_model"


def flash_attn_view(module: str, description: str) -> Patch:
    """``module``'s own ``get_args`` reads ``use_flash_attn`` as True (its packed path);
    only that module's name is wrapped, never the global ``get_args``."""
    return Patch(
        feature=FEATURE,
        target=f"{module}:get_args",
        wrapper=mindspeed_mm.vit_get_args,
        checked=CHECKED_MM,
        rebind_aliases=False,
        description=description,
    )


PATCHES = [
    Patch(
        feature=FEATURE,
        target="megatron.core.transformer.dot_product_attention:DotProductAttention.forward",
        wrapper=megatron_core_attention.dot_product_attention_forward,
        params="self, query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params",
        checked=CHECKED_MEGATRON,
        description="varlen attention when packed_seq_params is given (THD), upstream path otherwise",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.models.vlm_model:VLMModel.forward",
        wrapper=mindspeed_mm.vlm_forward,
        params="self, input_ids, pixel_values, image_grid_thw, attention_mask, labels, inference_params, "
               "decoder_input, position_ids, packed_seq_params",
        checked=CHECKED_MM,
        description="turn the loader's cu_seqlens into packed_seq_params and keep them for the decoder",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.models.common.mm_gpt_model:MMGPTModel.forward",
        wrapper=mindspeed_mm.mm_gpt_forward,
        params="self, input_ids, position_ids, attention_mask, decoder_input, labels, inference_params, "
               "packed_seq_params",
        checked=CHECKED_MM,
        description="receive the packed_seq_params VLMModel.forward does not pass on",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.models.vision.vlm_attentionmask_for_llm:prepare_positionsids_mask_for_llm",
        wrapper=mindspeed_mm.prepare_mask_for_llm,
        params="config, input_ids, inference_params, attention_mask, position_ids",
        checked=CHECKED_MM,
        description="no dense [B,1,S,S] LLM mask for a packed batch",
    ),
    Patch(
        feature=FEATURE,
        target=f"{VIT}:apply_multimodal_rotary_pos_emb",
        wrapper=mindspeed_mm.mrope_on_packed,
        params="q, k, cos, sin, use_fused_rope",
        checked=CHECKED_MM,
        description="M-RoPE on packed (squeezed THD) LLM queries",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed.core.transformer.flash_attention.generate_mask.adaptor:get_attention_mask",
        wrapper=mindspeed_mm.no_global_mask_when_packed,
        params="config",
        checked=(source(MINDSPEED),),
        optional=True,
        description="MindSpeed's mask generator (GenerateMaskFeature) builds no dense [S,S] mask for a packed call",
    ),
    flash_attn_view(VIT, "Qwen2VLViT.forward reads use_flash_attn=True: cu_seqlens, no dense block mask"),
    flash_attn_view(QWEN3_VIT, "Qwen3VLViT.forward reads use_flash_attn=True: cu_seqlens, no dense [1,S,S] mask"),
    flash_attn_view(VIT_BLOCK, "the ViT blocks pass cu_seqlens / cu_window_seqlens as PackedSeqParams"),
]
