"""Seeded workload generators behind configs/workloads/."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

from mindspeed_flow.packing.workloads import generate, sample, vision_tokens

SPECS = sorted((Path(__file__).resolve().parents[2] / "configs" / "workloads").glob("*.yaml"))


def test_vision_tokens_follow_qwen2_vl_resize():
    assert vision_tokens(np.array([448.0]), np.array([448.0]), 3136, 200704).tolist() == [256]
    # A 1700 x 2200 page under a 4096-token cap is scaled down as a whole.
    tokens = vision_tokens(np.array([2200.0]), np.array([1700.0]), 3136, 4096 * 28 * 28)
    assert 3800 <= tokens[0] <= 4096
    assert vision_tokens(np.array([10.0]), np.array([10.0]), 3136, 10**7).tolist() == [4]  # min_pixels


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_workloads_are_seeded_and_consistent(path):
    spec = yaml.safe_load(path.read_text())
    assert spec["why"].strip() and spec["name"] == path.stem
    first, again = generate(spec, 3000, seed=7), generate(spec, 3000, seed=7)
    assert np.array_equal(first.lengths, again.lengths)
    assert not np.array_equal(first.lengths, generate(spec, 3000, seed=8).lengths)
    assert (first.lengths > 0).all()
    assert first.image_offsets[-1] == len(first.image_patches) and (first.image_patches % 4 == 0).all()
    # Vision tokens (patches / 4) never exceed a sample's length.
    per_sample = np.add.reduceat(first.image_patches, first.image_offsets[:-1]) // 4
    per_sample[np.diff(first.image_offsets) == 0] = 0
    assert (per_sample < first.lengths).all()


def test_caption_lengths_are_text_plus_template_plus_fixed_image():
    spec = yaml.safe_load(next(p for p in SPECS if p.stem == "caption_pretrain").read_text())
    work = generate(spec, 2000, seed=0)
    assert (work.image_patches == 4 * 256).all()
    assert work.lengths.min() >= 256 + 10 + 3 and work.lengths.max() <= 256 + 10 + 256


def test_unknown_distribution_is_an_error():
    with pytest.raises(ValueError, match="unknown distribution 'zipf'"):
        sample({"dist": "zipf"}, 3, np.random.default_rng(0))


def test_long_tail_workload_is_heavy_tailed_with_many_distinct_lengths():
    """What the packer's speed fix is measured on: nearly every length below C occurs, and a
    small share of samples is longer than an 8k pack."""
    spec = yaml.safe_load(next(p for p in SPECS if p.stem == "long_tail_sft").read_text())
    lengths = generate(spec, 50_000, seed=0).lengths
    assert len(np.unique(lengths[lengths <= 8192])) > 5000
    assert 0.01 < (lengths > 8192).mean() < 0.04
    assert np.percentile(lengths, 99) > 8 * np.median(lengths)  # the tail
