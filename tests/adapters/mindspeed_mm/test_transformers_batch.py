"""The plugin's pack as ``TransformersModel`` (Qwen3-VL on ``pretrain_transformers.py``) takes it:
``seqlens`` per sample (and the padding segment), ``indices``, images in pack order, the
plugin's positions only for a pack holding a split sample's chunk, no image keys without images."""

from __future__ import annotations

import torch

from mindspeed_flow.adapters.mindspeed_mm.transformers_batch import transformers_model_batch
from mindspeed_flow.data.batch import collate_pack
from mindspeed_flow.data.decode import Sample
from mindspeed_flow.data.images import ImageGeometry

QWEN3_VL = ImageGeometry(16, 2, 2, (0.5,) * 3, (0.5,) * 3, 64 * 64, 128 * 128)
IMAGE_PAD = 7


def _sample(index: int, length: int, images: int = 0, sample_id: str | None = None) -> Sample:
    ids = torch.arange(length) % 5 + 10
    ids[1:1 + 4 * images] = IMAGE_PAD  # each image a 4 x 4 patch grid: 4 tokens after the merge
    pixels = torch.full((16 * images, QWEN3_VL.row_size), index, dtype=torch.uint8)
    return Sample(index, sample_id or f"d.json:{index + 1}", ids, ids.clone(), torch.arange(length).expand(3, -1) + index,
                  pixels, torch.tensor([[1, 4, 4]] * images, dtype=torch.int64).reshape(-1, 3))


def test_a_pack_becomes_seqlens_indices_and_images_in_pack_order():
    samples = [_sample(0, 9, images=1), _sample(1, 6), _sample(2, 12, images=2)]
    pack = collate_pack(samples, multiple=4, pad_id=0, geometry=QWEN3_VL)  # 27 tokens padded to 28
    batch = transformers_model_batch(pack)
    assert batch["seqlens"].tolist() == [9, 6, 12, 1] and batch["seqlens"].dtype == torch.int64
    assert batch["indices"].tolist() == list(range(28))
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (1, 28)
    assert int(batch["attention_mask"].sum()) == 27
    # images in pack order: sample 0's one, then sample 2's two (their pixels carry the sample index)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] * 3 and batch["pixel_values"].shape == (48, 1536)
    assert torch.equal(batch["pixel_values"][:, 0], (torch.tensor([0] * 16 + [2] * 32) / 255 - 0.5) / 0.5)
    assert "position_ids" not in batch and "cu_seqlens" not in batch  # the model derives both
    assert batch["sample_ids"] == ["d.json:1", "d.json:2", "d.json:3"]


def test_a_pack_with_a_split_chunk_keeps_the_plugins_positions():
    samples = [_sample(0, 9, images=1), _sample(5, 6, sample_id="d.json:6#1/2")]
    pack = collate_pack(samples, geometry=QWEN3_VL)
    batch = transformers_model_batch(pack)
    assert torch.equal(batch["position_ids"], pack["position_ids"]) and batch["seqlens"].tolist() == [9, 6]


def test_a_pack_without_images_hands_no_image_keys():
    batch = transformers_model_batch(collate_pack([_sample(0, 5), _sample(1, 3)], geometry=QWEN3_VL))
    assert "pixel_values" not in batch and "image_grid_thw" not in batch and batch["seqlens"].tolist() == [5, 3]
