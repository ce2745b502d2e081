"""The plugin's pack as ``TransformersModel`` (Qwen3-VL on ``pretrain_transformers.py``) takes it:
``seqlens`` per sample (and the padding segment), ``indices``, images in pack order, the
plugin's positions only for a pack holding a split sample's chunk, no image keys without images
unless a fake image is given, which then becomes the pack's own trailing segment."""

from __future__ import annotations

import torch

from mindspeed_flow.adapters.mindspeed_mm.transformers_batch import fake_image, transformers_model_batch
from mindspeed_flow.data.batch import collate_pack
from mindspeed_flow.data.decode import Sample
from mindspeed_flow.data.images import ImageGeometry, normalize
from mindspeed_flow.data.tokenizer import SpecialIds

QWEN3_VL = ImageGeometry(16, 2, 2, (0.5,) * 3, (0.5,) * 3, 64 * 64, 128 * 128)
IMAGE_PAD = 7
SPECIAL = SpecialIds(pad=0, im_start=1, im_end=2, vision_start=3, vision_end=4, image_pad=IMAGE_PAD)


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


def test_a_pack_without_images_gets_the_fake_image_as_its_own_ignored_segment():
    fake = fake_image(QWEN3_VL, SPECIAL)
    # white 64x64 in 16-pixel patches, merge 2: a 4 x 4 patch grid, 4 image tokens
    assert fake.image_grid_thw.tolist() == [[1, 4, 4]] and fake.pixel_values.shape == (16, QWEN3_VL.row_size)
    assert torch.equal(fake.pixel_values, normalize(torch.full((16, QWEN3_VL.row_size), 255, dtype=torch.uint8),
                                                    QWEN3_VL))
    pack = collate_pack([_sample(0, 5), _sample(1, 3)], multiple=4, pad_id=0, geometry=QWEN3_VL)  # 8 tokens
    batch = transformers_model_batch(pack, fake)
    assert batch["seqlens"].tolist() == [5, 3, 6]  # 6 = vision_start + 4 image pads + vision_end
    assert batch["input_ids"][0, 8:].tolist() == [3, 7, 7, 7, 7, 4]
    assert torch.equal(batch["input_ids"][:, :8], pack["input_ids"]) and torch.equal(batch["labels"][:, :8], pack["labels"])
    assert batch["labels"][0, 8:].tolist() == [-100] * 6 and batch["attention_mask"][0, 8:].tolist() == [0] * 6
    assert torch.equal(batch["attention_mask"][:, :8], pack["attention_mask"])
    assert batch["indices"].tolist() == list(range(14))
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]] and torch.equal(batch["pixel_values"], fake.pixel_values)
    assert "position_ids" not in batch


def test_a_split_chunk_without_images_gets_the_fake_images_positions_appended():
    fake = fake_image(QWEN3_VL, SPECIAL)
    pack = collate_pack([_sample(5, 6, sample_id="d.json:6#1/2")], geometry=QWEN3_VL)
    batch = transformers_model_batch(pack, fake)
    assert batch["position_ids"].shape == (3, 1, 12) and torch.equal(batch["position_ids"][:, :, :6], pack["position_ids"])
    assert torch.equal(batch["position_ids"][:, :, 6:], fake.position_ids) and batch["seqlens"].tolist() == [6, 6]


def test_a_pack_with_images_is_unchanged_by_the_fake_image():
    pack = collate_pack([_sample(0, 9, images=1), _sample(1, 6)], multiple=4, pad_id=0, geometry=QWEN3_VL)
    with_fake, without = transformers_model_batch(pack, fake_image(QWEN3_VL, SPECIAL)), transformers_model_batch(pack)
    assert with_fake.keys() == without.keys()
    assert all(torch.equal(with_fake[k], without[k]) for k in with_fake if isinstance(with_fake[k], torch.Tensor))
