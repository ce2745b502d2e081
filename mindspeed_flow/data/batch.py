"""The batch contract: one pack of samples -> one microbatch for MindSpeed-MM's Qwen2.5-VL.

``B = 1`` and ``T`` = the pack's tokens (no padding):

- ``input_ids``, ``labels``, ``attention_mask``: ``[1, T]``; the label of every sample's
  first token is -100, so the shifted loss never predicts across a sample boundary.
- ``cu_seqlens``: int32 ``[n + 1]`` segment ends, starting at 0 (what the ``fused_attn``
  patch of ``VLMModel.forward`` turns into ``packed_seq_params``).
- ``position_ids``: int64 ``[3, 1, T]`` M-RoPE ids, per sample as if it were alone.
- ``pixel_values``: float32 ``[sum t*h*w, 1176]`` and ``image_grid_thw``: int64 ``[N, 3]``,
  images in sample order.
- ``sample_ids``: the samples' ids in pack order (``file:line``; ``file:line#k/n`` for
  chunk ``k`` of a sample split into ``n``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .conversation import IGNORE
from .decode import Sample
from .images import normalize
from .mrope import packed_position_ids

TENSOR_KEYS = ("input_ids", "labels", "attention_mask", "cu_seqlens", "position_ids", "pixel_values",
               "image_grid_thw")


def collate_pack(samples: Sequence[Sample]) -> dict[str, Any]:
    if not samples:
        raise ValueError("a pack needs at least one sample")
    lengths = [len(s) for s in samples]
    labels = torch.cat([s.labels for s in samples]).clone()
    starts = torch.tensor([0] + lengths).cumsum(0)
    labels[starts[:-1]] = IGNORE
    input_ids = torch.cat([s.input_ids for s in samples])
    return {
        "input_ids": input_ids.unsqueeze(0),
        "labels": labels.unsqueeze(0),
        "attention_mask": torch.ones(1, len(input_ids), dtype=torch.int64),
        "cu_seqlens": starts.to(torch.int32),
        "position_ids": packed_position_ids([s.position_ids for s in samples]),
        "pixel_values": normalize(torch.cat([s.pixel_values for s in samples])),
        "image_grid_thw": torch.cat([s.image_grid_thw for s in samples]).reshape(-1, 3),
        "sample_ids": [s.sample_id for s in samples],
    }


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
