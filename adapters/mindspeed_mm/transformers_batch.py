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

A pack without images gets a fake image (:class:`FakeImage`) as its own trailing segment, as
upstream's collator gives an image-less batch a white 64x64 one: Qwen3-VL runs its ViT only
``if pixel_values is not None``, and under FSDP2 with DP > 1 the ViT's blocks are sharded (an
all-gather in forward, a reduce-scatter in backward), so a rank skipping the ViT while its
peers run it can hang.  The fake segment's tokens have labels -100 and attention_mask 0 and an
``seqlens`` entry of their own (no real token attends to them, they attend to none), so the
loss and every real token are unchanged and the ViT gets a zero gradient from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from mindspeed_flow.data.batch import holds_split_chunk, segment_lengths
from mindspeed_flow.data.conversation import IGNORE
from mindspeed_flow.data.images import ImageGeometry, normalize, patchify, resized_size
from mindspeed_flow.data.mrope import mrope_position_ids
from mindspeed_flow.data.tokenizer import SpecialIds

FAKE_IMAGE_SIDE = 64  # upstream's collator: a white 64x64 RGB image

MODEL_KEYS = ("input_ids", "labels", "attention_mask", "pixel_values", "image_grid_thw")


@dataclass(frozen=True)
class FakeImage:
    """The segment a pack without images gets: ``input_ids`` (int64 ``[n]``: vision_start,
    ``n - 2`` image pads, vision_end), ``pixel_values`` (float32, a white 64x64 image cut and
    normalised in the job's geometry), ``image_grid_thw`` (int64 ``[1, 3]``) and
    ``position_ids`` (``[3, 1, n]``, the segment's M-RoPE ids as a sample alone)."""

    input_ids: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    position_ids: torch.Tensor


def fake_image(geometry: ImageGeometry, special: SpecialIds) -> FakeImage:
    """The fake image of a job cutting images in ``geometry`` with token ids ``special``: the
    white image resized within the geometry's pixel bounds as a real one would be."""
    height, width = resized_size(FAKE_IMAGE_SIDE, FAKE_IMAGE_SIDE, geometry.min_pixels, geometry.max_pixels,
                                 geometry.factor)
    rows, grid = patchify(np.full((height, width, 3), 255, dtype=np.uint8), geometry)
    ids = torch.tensor([special.vision_start] + [special.image_pad] * geometry.tokens(grid) + [special.vision_end],
                       dtype=torch.int64)
    positions = mrope_position_ids(ids, [grid], image_token_id=special.image_pad,
                                   vision_start_token_id=special.vision_start, spatial_merge_size=geometry.merge)
    return FakeImage(ids, normalize(torch.from_numpy(rows), geometry), torch.tensor([grid], dtype=torch.int64),
                     positions.unsqueeze(1))


def _with_fake_image(batch: dict[str, Any], fake: FakeImage) -> dict[str, Any]:
    """``batch`` (keys of :data:`MODEL_KEYS`, ``seqlens``, maybe ``position_ids``) with ``fake``
    appended as its own trailing segment."""
    n = int(fake.input_ids.numel())
    ids = batch["input_ids"]
    batch["input_ids"] = torch.cat([ids, fake.input_ids.to(ids.dtype)[None]], dim=1)
    batch["labels"] = torch.cat([batch["labels"], batch["labels"].new_full((1, n), IGNORE)], dim=1)
    batch["attention_mask"] = torch.cat([batch["attention_mask"], batch["attention_mask"].new_zeros((1, n))], dim=1)
    batch["seqlens"] = torch.cat([batch["seqlens"], torch.tensor([n], dtype=torch.int64)])
    batch["pixel_values"], batch["image_grid_thw"] = fake.pixel_values, fake.image_grid_thw
    if "position_ids" in batch:
        batch["position_ids"] = torch.cat([batch["position_ids"], fake.position_ids.to(batch["position_ids"].dtype)],
                                          dim=2)
    return batch


def transformers_model_batch(pack: dict[str, Any], fake: Optional[FakeImage] = None) -> dict[str, Any]:
    """One pack of :class:`~mindspeed_flow.data.FlowDataLoader` (the plugin's batch contract,
    :mod:`mindspeed_flow.data.batch`: ``input_ids``/``labels``/``attention_mask`` ``[1, S]``,
    ``cu_seqlens``, ``position_ids [3, 1, S]``, ``pixel_values``, ``image_grid_thw``,
    ``sample_ids``) -> the keyword arguments ``TransformersModel.forward`` takes for a packed
    microbatch: ``input_ids``, ``labels``, ``attention_mask`` (``[1, S]``), ``seqlens``
    (int64 ``[n]``, one per sample and one for the padding when the pack is padded),
    ``indices`` (int64 ``[S]``), ``pixel_values`` / ``image_grid_thw``, ``position_ids`` only
    for a pack holding a split sample's chunk (see the module docstring), and ``sample_ids``.
    A pack without images gets ``fake`` appended as one more segment (``S`` grows by its
    tokens); without ``fake`` it hands no image keys."""
    batch = {key: pack[key] for key in MODEL_KEYS}
    batch["seqlens"] = segment_lengths(pack)
    if holds_split_chunk(pack["sample_ids"]):
        batch["position_ids"] = pack["position_ids"]
    if not int(batch["image_grid_thw"].shape[0]):
        del batch["pixel_values"], batch["image_grid_thw"]
        if fake is not None:
            batch = _with_fake_image(batch, fake)
    batch["indices"] = torch.arange(batch["input_ids"].shape[1], dtype=torch.int64)
    batch["sample_ids"] = pack["sample_ids"]
    return batch
