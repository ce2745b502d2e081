"""MindSpeed-MM's microbatches cut into the flow's samples (``flow_batches.StepBatches``) and
grouped for the encoder with the loader's packs kept (``flow.packed.group_packed``): the
decoupled layout's ``flow: true`` in the real job reads both.  Batches are built by the
packing loader's own collator (``collate_pack``) from decoded samples, so the contract is the
one the real job hands every rank."""

from __future__ import annotations

import pytest
import torch

from mindspeed_flow.adapters.mindspeed_mm.flow_batches import StepBatches
from mindspeed_flow.flow import EncoderCost, GroupingError, SampleError
from mindspeed_flow.flow.packed import group_packed

IMAGE = 151655
PATCH_VALUES = 6  # pixel row width: any; the rows are followed, not read


def sample_batch(grids: list[list[tuple[int, int, int]]], text: int = 3, pack: bool = True) -> dict:
    """One microbatch of samples with the given images (``t, h, w`` patches each, 4 patches a
    token), as the packing loader lays it out (one row, ``cu_seqlens``, ``sample_ids``) or,
    with ``pack=False`` and one sample, as upstream's collator does (one row, no segments)."""
    ids, pixels, thw, bounds = [], [], [], [0]
    for s, images in enumerate(grids):
        tokens = []
        for t, h, w in images:
            tokens += [IMAGE] * (t * h * w // 4)
            rows = t * h * w
            pixels.append(torch.arange(rows * PATCH_VALUES, dtype=torch.float32).reshape(rows, PATCH_VALUES)
                          + 1000 * len(pixels))
            thw.append([t, h, w])
        tokens += [7 + s] * text
        ids += tokens
        bounds.append(len(ids))
    batch = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
             "pixel_values": torch.cat(pixels) if pixels else None,
             "image_grid_thw": torch.tensor(thw) if thw else None}
    if pack:
        batch["cu_seqlens"] = torch.tensor(bounds + [bounds[-1] + 5], dtype=torch.int32)  # a padding segment
        batch["input_ids"] = torch.cat([batch["input_ids"], torch.zeros(1, 5, dtype=torch.long)], dim=1)
        batch["sample_ids"] = [f"data.json:{s}" for s in range(len(grids))]
    return batch


def test_packs_are_cut_into_samples_with_their_own_images_and_pixels():
    first = sample_batch([[(1, 4, 4)], [(1, 8, 8), (1, 2, 2)], []])
    second = sample_batch([[(1, 4, 6)]], pack=False)
    step = StepBatches(3, [first, second], IMAGE)
    assert step.microbatches == [(0, 1, 2), (3,)]
    assert [(m.sample_id, m.step, m.image_tokens, m.patches) for m in step.metas] == [
        (0, 3, 4, (16,)), (1, 3, 17, (64, 4)), (2, 3, 0, ()), (3, 3, 6, (24,))]
    assert [m.llm_tokens for m in step.metas] == [4 + 3, 17 + 3, 3, 6 + 3]  # the padding segment is no sample
    joined = step.encoder_input([step.metas[1], step.metas[3], step.metas[2]])
    assert torch.equal(joined["pixel_values"], torch.cat([first["pixel_values"][16:], second["pixel_values"]]))
    assert joined["image_grid_thw"].tolist() == [[1, 8, 8], [1, 2, 2], [1, 4, 6]]
    assert joined["input_ids"].shape == (1, 20 + 9 + 3)


def test_a_sample_whose_image_tokens_its_images_do_not_make_is_refused_naming_it():
    batch = sample_batch([[(1, 4, 4)], [(1, 4, 4)]])
    batch["input_ids"][0, 5] = IMAGE  # one image token too many in the first sample, one patch short
    with pytest.raises(SampleError, match="microbatch 0"):
        StepBatches(0, [batch], IMAGE)
    extra = sample_batch([[(1, 4, 4)]])
    extra["image_grid_thw"] = torch.tensor([[1, 4, 4], [1, 2, 2]])
    extra["pixel_values"] = torch.cat([extra["pixel_values"], torch.zeros(4, PATCH_VALUES)])
    with pytest.raises(SampleError, match="image tokens"):
        StepBatches(0, [extra], IMAGE)


def test_the_loaders_packs_stay_the_llms_microbatches_and_the_encoder_cuts_its_own():
    step = StepBatches(0, [sample_batch([[(1, 8, 8)], [(1, 4, 4)]]), sample_batch([[(1, 4, 4)], [], [(1, 4, 6)]])],
                       IMAGE)
    grouping = group_packed(step.metas, step.microbatches, encoder_cost=EncoderCost(linear=1.0),
                            encoder_budget=40.0, pp=2)
    assert grouping.microbatches == ((0, 1), (2, 3, 4))
    assert grouping.batches == ((0,), (1, 2), (4,))  # 64 alone; 16 + 16; 24 (16 + 16 + 24 > 40)
    assert grouping.batches != grouping.microbatches
    assert grouping.microbatch_replica == (0, 0) and grouping.batch_replica == (0, 0, 0)
    with pytest.raises(GroupingError, match="sample 4 is in no LLM microbatch"):
        group_packed(step.metas, [(0, 1), (2, 3)], encoder_cost=EncoderCost(linear=1.0), encoder_budget=40.0)
