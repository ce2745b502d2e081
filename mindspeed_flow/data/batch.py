"""The batch contract: one pack of samples -> one microbatch for MindSpeed-MM's Qwen2.5-VL.

``B = 1`` and ``T`` = the pack's tokens, padded up to a multiple of ``multiple`` (1: no
padding; tensor and sequence parallelism need the sequence divisible by TP x CP, see
:func:`pack_multiple`):

- ``input_ids``, ``labels``, ``attention_mask``: ``[1, T]``; the label of every sample's
  first token is -100, so the shifted loss never predicts across a sample boundary.
  Padding (at the end) is ``pad_id`` tokens with label -100 and attention mask 0, so
  ``attention_mask.sum()`` is the pack's real tokens (:func:`real_tokens`).
- ``cu_seqlens``: int32 ``[n + 1]`` segment ends, starting at 0 (what the ``fused_attn``
  patch of ``VLMModel.forward`` turns into ``packed_seq_params``); ``[n + 2]`` when the
  pack is padded: the padding is a segment of its own, last, so no real token attends to
  it (causal attention never looks ahead) and it attends to no real token.
- ``position_ids``: int64 ``[3, 1, T]`` M-RoPE ids, per sample as if it were alone (the
  padding too: ``0, 1, ...`` on all three axes, as a text-only sample).
- ``pixel_values``: float32 ``[sum t*h*w, C*T*P*P]`` (1176 for Qwen2-VL's 14-pixel patches;
  the processor's geometry, :class:`.images.ImageGeometry`) and ``image_grid_thw``: int64 ``[N, 3]``,
  images in sample order.
- ``sample_ids``: the samples' ids in pack order (``file:line``; ``file:line#k/n`` for
  chunk ``k`` of a sample split into ``n``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .conversation import IGNORE
from .decode import Sample
from .images import QWEN2_VL, ImageGeometry, normalize_joined
from .mrope import packed_position_ids

TENSOR_KEYS = ("input_ids", "labels", "attention_mask", "cu_seqlens", "position_ids", "pixel_values",
               "image_grid_thw")


def pack_multiple(tensor_parallel: int = 1, context_parallel: int = 1, sequence_parallel: bool = False) -> int:
    """What a pack's length must be a multiple of: Megatron's sequence parallelism splits the
    sequence over the ``tensor_parallel`` ranks (the embedding's reduce-scatter needs it
    divisible by TP); context parallelism splits it into ``2 * context_parallel`` chunks
    (load-balanced causal attention), each then split over TP when both are on."""
    for name, value in (("tensor_parallel", tensor_parallel), ("context_parallel", context_parallel)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    return (tensor_parallel if sequence_parallel else 1) * (2 * context_parallel if context_parallel > 1 else 1)


def padded_length(tokens: int, multiple: int) -> int:
    """``tokens`` rounded up to a multiple of ``multiple``."""
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    return -(-tokens // multiple) * multiple


def collate_pack(samples: Sequence[Sample], multiple: int = 1, pad_id: int = 0,
                 geometry: ImageGeometry = QWEN2_VL) -> dict[str, Any]:
    """One pack of ``samples`` in the batch contract (module docstring), padded at the end to a
    multiple of ``multiple`` tokens with ``pad_id``; pixels normalised with ``geometry``'s
    mean/std (the processor's)."""
    return join_pack(samples, normalize_joined([s.pixel_values for s in samples], geometry), multiple, pad_id)


def join_pack(samples: Sequence[Sample], pixel_values: torch.Tensor, multiple: int = 1,
              pad_id: int = 0) -> dict[str, Any]:
    """:func:`collate_pack` with the pack's pixel rows given (``pixel_values``: the samples'
    rows in order, already normalised): what the loader joins, and what the decoupled
    layout's flow joins again when it regroups samples cut out of the loader's packs
    (:mod:`mindspeed_flow.adapters.mindspeed_mm.flow_batches`).  New tensors are made on
    the samples' device."""
    if not samples:
        raise ValueError("a pack needs at least one sample")
    device = samples[0].input_ids.device
    lengths = [len(s) for s in samples]
    real = sum(lengths)
    pad = padded_length(real, multiple) - real
    labels = torch.cat([s.labels for s in samples] + [torch.full((pad,), IGNORE, dtype=torch.int64, device=device)])
    starts = torch.tensor([0] + lengths + ([pad] if pad else [])).cumsum(0)
    labels[starts[:-1].to(device)] = IGNORE
    input_ids = torch.cat([s.input_ids for s in samples]
                          + [torch.full((pad,), pad_id, dtype=torch.int64, device=device)])
    attention_mask = torch.ones(1, real + pad, dtype=torch.int64, device=device)
    attention_mask[0, real:] = 0
    positions = [s.position_ids for s in samples] + ([torch.arange(pad, device=device).expand(3, pad)] if pad else [])
    return {
        "input_ids": input_ids.unsqueeze(0),
        "labels": labels.unsqueeze(0),
        "attention_mask": attention_mask,
        "cu_seqlens": starts.to(device=device, dtype=torch.int32),
        "position_ids": packed_position_ids(positions),
        "pixel_values": pixel_values,
        "image_grid_thw": torch.cat([s.image_grid_thw for s in samples]).reshape(-1, 3),
        "sample_ids": [s.sample_id for s in samples],
    }


def real_tokens(batch: dict[str, Any]) -> int:
    """The tokens of a packed batch that are not padding."""
    return int(batch["attention_mask"].sum())


def completed_samples(sample_ids: Sequence[str]) -> int:
    """Samples a pack completes: whole samples, and split ones in the pack of their last chunk."""
    done = 0
    for sample_id in sample_ids:
        _, split, chunk = sample_id.rpartition("#")
        if not split:
            done += 1
        else:
            k, n = chunk.split("/")
            done += int(k) == int(n) - 1
    return done


def segment_lengths(batch: dict[str, Any]) -> torch.Tensor:
    """int64 ``[n]``: the tokens of each segment of a packed batch, in pack order (its samples,
    then the padding segment when the pack is padded): ``cu_seqlens``' differences."""
    return batch["cu_seqlens"].diff().to(torch.int64)


def holds_split_chunk(sample_ids: Sequence[str]) -> bool:
    """Whether a pack holds a chunk of a sample split over packs (``file:line#k/n``): such a
    chunk's positions continue its sample's, which its own tokens cannot tell."""
    return any("#" in sample_id for sample_id in sample_ids)
