"""The plugin's packed batch as MindSpeed-MM's ``TransformersModel`` (Qwen3-VL on
``pretrain_transformers.py``) consumes a packed microbatch.

What that model reads of a pack (57069cd, ``models/transformers/qwen3vl/modeling_qwen3_vl.py``,
the layout of upstream's own ``DynamicBatchingDataLoader.collect_fn``): ``input_ids``,
``labels`` and ``attention_mask`` as ``[1, S]``; ``seqlens`` (int64 ``[n]``: the pack's
sequence lengths), from which its text model builds the varlen ``cu_seqlens`` of the TND
attention and its ``get_rope_index(..., sequence_length=seqlens)`` the M-RoPE ids of each
sample as if it were alone; ``indices`` (the unpadded token positions, here all of ``0..S-1``);
``pixel_values`` / ``image_grid_thw`` with the images in pack order, so the ViT's features and
its DeepStack features land on the image tokens in that order (``masked_scatter`` and
``visual_pos_masks``).  The plugin's own ``cu_seqlens`` and ``position_ids`` are not handed
over (the model derives both), except the positions of a pack that holds a chunk of a sample
split over packs: that chunk's ids continue its sample's, which ``get_rope_index`` over the
chunk alone cannot know (it would also miscount a chunk that starts inside an image block), so
the plugin's per-sample ids (:mod:`mindspeed_flow.data.mrope`, equal to the model's for images)
go instead.  ``sample_ids`` stays for the accounting (upstream's ``move_to_device`` drops lists
of strings before the model is called).
"""

from __future__ import annotations

from typing import Any

import torch

from mindspeed_flow.data.batch import holds_split_chunk, segment_lengths

MODEL_KEYS = ("input_ids", "labels", "attention_mask", "pixel_values", "image_grid_thw")


def transformers_model_batch(pack: dict[str, Any]) -> dict[str, Any]:
    """One pack of :class:`~mindspeed_flow.data.FlowDataLoader` (the plugin's batch contract,
    :mod:`mindspeed_flow.data.batch`: ``input_ids``/``labels``/``attention_mask`` ``[1, S]``,
    ``cu_seqlens``, ``position_ids [3, 1, S]``, ``pixel_values``, ``image_grid_thw``,
    ``sample_ids``) -> the keyword arguments ``TransformersModel.forward`` takes for a packed
    microbatch: ``input_ids``, ``labels``, ``attention_mask`` (``[1, S]``), ``seqlens``
    (int64 ``[n]``, one per sample and one for the padding when the pack is padded),
    ``indices`` (int64 ``[S]``), ``pixel_values`` / ``image_grid_thw`` (left out for a pack
    without images), ``position_ids`` only for a pack holding a split sample's chunk (see the
    module docstring), and ``sample_ids``."""
    batch = {key: pack[key] for key in MODEL_KEYS}
    if not int(batch["image_grid_thw"].shape[0]):
        del batch["pixel_values"], batch["image_grid_thw"]
    batch["seqlens"] = segment_lengths(pack)
    batch["indices"] = torch.arange(pack["input_ids"].shape[1], dtype=torch.int64)
    if holds_split_chunk(pack["sample_ids"]):
        batch["position_ids"] = pack["position_ids"]
    batch["sample_ids"] = pack["sample_ids"]
    return batch
