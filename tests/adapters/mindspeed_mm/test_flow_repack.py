"""The backbone's microbatches made again after encoding (the decoupled layout's ``flow_repack``):
``StepBatches.repack`` cuts each sample out of the packing loader's packs and joins the new
groups with the loader's own join, so a regrouped pack is the pack the loader makes of those
samples, key for key and bit for bit (tokens, labels, M-RoPE ids, ``cu_seqlens``, attention
mask, padding, normalised pixels, image grids, sample ids)."""

from __future__ import annotations

import pytest
import torch

from mindspeed_flow.adapters.mindspeed_mm.data import FlowTrainIterator
from mindspeed_flow.adapters.mindspeed_mm.flow_batches import PackSettings, StepBatches, pack_settings
from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.loader import default_cost_model
from mindspeed_flow.data.batch import collate_pack
from mindspeed_flow.data.decode import Sample
from mindspeed_flow.data.mrope import IMAGE_TOKEN_ID, VISION_START_TOKEN_ID, mrope_position_ids
from mindspeed_flow.flow import SampleError

from data_corpus import demo_corpus

VISION_END = 151653
ROW = 1176  # Qwen2-VL's pixel row (3 x 2 x 14 x 14)


def make_sample(index: int, grids: list[tuple[int, int, int]], text: int) -> Sample:
    """A decoded sample as the loader's decoder makes it: per image ``<vision_start>``, its
    image tokens (4 patches a token), ``<vision_end>``; then text; uint8 pixel rows; its own
    M-RoPE ids; labels on the text."""
    g = torch.Generator().manual_seed(index)
    ids: list[int] = []
    for t, h, w in grids:
        ids += [VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * (t * h * w // 4) + [VISION_END]
    input_ids = torch.tensor(ids + torch.randint(10, 5000, (text,), generator=g).tolist())
    labels = input_ids.clone()
    labels[:len(ids)] = -100
    rows = sum(t * h * w for t, h, w in grids)
    grid = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
    return Sample(index, f"data.jsonl:{index + 1}", input_ids, labels, mrope_position_ids(input_ids, grid),
                  torch.randint(0, 256, (rows, ROW), generator=g, dtype=torch.uint8), grid)


SAMPLES = [make_sample(0, [(1, 8, 8)], 5), make_sample(1, [], 9), make_sample(2, [(1, 4, 6), (1, 2, 2)], 3),
           make_sample(3, [(1, 4, 4)], 12), make_sample(4, [], 4)]


def assert_same_pack(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        if torch.is_tensor(value):
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def repacked(step: StepBatches, groups, multiple: int = 1) -> list[dict]:
    step.repack(groups, multiple)
    return step.batches  # joined here, on first use


@pytest.mark.parametrize("multiple", [1, 8])
def test_regrouped_packs_are_the_loaders_packs_of_those_samples(multiple):
    """Loader packs ``[0, 1] [2, 3, 4]`` (the loader's join, padded to ``multiple``) regrouped
    as ``[3, 0] [4] [1, 2]``: each new pack equals ``collate_pack`` of those decoded samples in
    that order; regrouped in the loader's own groups, the packs come back bit for bit."""
    packs = [collate_pack([SAMPLES[i] for i in group], multiple, pad_id=7) for group in ([0, 1], [2, 3, 4])]
    step = StepBatches(0, packs, IMAGE_TOKEN_ID)
    assert step.loader_microbatches == [(0, 1), (2, 3, 4)]
    assert step.pad_id == (7 if multiple > 1 else None)
    for got, expected in zip(repacked(step, step.loader_microbatches, multiple), packs):
        assert_same_pack(got, expected)
    groups = [(3, 0), (4,), (1, 2)]
    for got, group in zip(repacked(step, groups, multiple), groups):
        assert_same_pack(got, collate_pack([SAMPLES[i] for i in group], multiple, pad_id=7))
    assert step.microbatches == groups and step.loader_batches == packs
    assert step.batches[0]["position_ids"].shape[:2] == (3, 1)


@pytest.fixture(scope="module")
def loader_packs(tmp_path_factory):
    """Six of the real loader's packs (demo corpus: images, text-only samples; padded to 8)."""
    corpus = demo_corpus(tmp_path_factory, samples=24)
    loader = FlowDataLoader(corpus, None, capacity=256, num_workers=0, window=4, seed=5, max_pixels=112 * 112,
                            pad_multiple=8, step_packs=3, pp_size=2)
    packs = []
    for batch in loader:
        packs.append(batch)
        if len(packs) == 6:
            return loader, packs
    raise AssertionError("the demo corpus made fewer than 6 packs")


def test_the_real_loaders_packs_cut_and_joined_again_are_bit_for_bit_the_same(loader_packs):
    """A step of the real ``FlowDataLoader``'s packs: cut into samples and joined again in
    their own groups, each pack is the loader's, key for key (its padding too)."""
    loader, packs = loader_packs
    step = StepBatches(0, packs, loader.special.image_pad)
    assert len(step.metas) > len(packs)  # several samples a pack: the regrouping has something to do
    for got, expected in zip(repacked(step, step.loader_microbatches, loader.pad_multiple), packs):
        assert_same_pack(got, expected)
    moved = [tuple(reversed(mb)) for mb in reversed(step.loader_microbatches)]
    assert [b["sample_ids"] for b in repacked(step, moved, loader.pad_multiple)] == \
        [list(reversed(p["sample_ids"])) for p in reversed(packs)]
    for batch in step.batches:
        assert batch["input_ids"].shape[1] % loader.pad_multiple == 0


def test_the_repacking_keeps_to_the_packing_loaders_capacity_cost_model_and_pad_multiple(loader_packs):
    """Through the job's iterator (and a wrapper such as Megatron's ``RerunDataIterator``):
    the loader's settings; without a packing loader, ``--seq-length`` and the loader's default cost."""
    loader, _ = loader_packs

    class Wrapper:  # stands for Megatron's RerunDataIterator, which holds the iterator as .iterable
        iterable = FlowTrainIterator(loader)

    assert pack_settings(Wrapper(), 4096) == PackSettings(256, loader.cost_model, 8)
    assert loader.cost_model == default_cost_model(256)
    assert pack_settings(iter([]), 4096) == PackSettings(4096, default_cost_model(4096), 1)


def test_a_batch_that_is_not_a_loader_pack_is_refused_naming_it():
    """Refused when the new packs are joined (a backbone rank's first use of ``batches``;
    an encoder rank never joins them)."""
    pack = collate_pack(SAMPLES[:2])
    unpacked = {k: v for k, v in pack.items() if k not in ("cu_seqlens", "position_ids", "sample_ids")}
    step = StepBatches(2, [pack, unpacked], IMAGE_TOKEN_ID)
    step.repack([(0, 2), (1,)])
    assert step.microbatches == [(0, 2), (1,)]
    with pytest.raises(SampleError, match="flow step 2 microbatch 1: cannot regroup a batch that is not a pack"):
        step.batches
    extra = {**pack, "video_grid_thw": torch.zeros(0, 3)}
    with pytest.raises(SampleError, match=r"microbatch 0: cannot regroup a batch with \['video_grid_thw'\]"):
        repacked(StepBatches(0, [extra], IMAGE_TOKEN_ID), [(1, 0)])
    unpadded = StepBatches(0, [pack], IMAGE_TOKEN_ID)  # no padded pack: the pad token is unknown
    with pytest.raises(SampleError, match="needs padding to a multiple of 64 tokens"):
        repacked(unpadded, [(1, 0)], multiple=64)
