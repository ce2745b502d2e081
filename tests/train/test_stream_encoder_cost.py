"""``data.encoder_cost``: the flow's encoder cost from the job's config (the calibration JSON's
``encoder_cost`` or coefficients), checked at load naming the key and the file, and the one
the flow's grouping (``train/stream.py``) cuts the encoder's batches by, each costing at most
one image of ``layout.flow_encoder_batch_patches`` patches."""

from __future__ import annotations

import pytest

from mindspeed_flow.flow import EncoderCost, FlowRanks, SampleMeta
from mindspeed_flow.flow.encoder_cost import PATCHES
from mindspeed_flow.train.config import load_config
from mindspeed_flow.train.stream import group_samples

from tests.train.test_stream_cost import assert_refused_at_load, write

PER_IMAGE_HEAVY = EncoderCost(linear=1.0, per_image=512.0)


def test_default_is_patches_and_file_or_coefficients_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config(write(tmp_path, "")).data.encoder_cost_model() == PATCHES
    inline = load_config(write(tmp_path, "  encoder_cost:\n    per_image: 512.0\n"))
    assert inline.data.encoder_cost_model() == PER_IMAGE_HEAVY
    from_file = load_config(write(tmp_path, "  encoder_cost:\n    file: cost_model.json\n",
                                  {"model": {"linear": 1.0}, "encoder_cost": {"linear": 1.0, "per_image": 512.0}}))
    assert from_file.data.encoder_cost_model() == PER_IMAGE_HEAVY


@pytest.mark.parametrize("section, content, expected", [
    ("  encoder_cost:\n    file: missing.json\n", None,
     r"data\.encoder_cost\.file: missing\.json: cannot read the calibrated cost model"),
    ("  encoder_cost:\n    file: cost_model.json\n", {"model": {}},
     r"data\.encoder_cost\.file: cost_model\.json: no 'encoder_cost' mapping"),
    ("  encoder_cost:\n    file: cost_model.json\n    per_image: 2.0\n", None,
     r"data\.encoder_cost: set either file \(cost_model\.json\) or the coefficients"),
    ("  encoder_cost:\n    linear: -1.0\n", None, r"data\.encoder_cost: coefficients: linear must be >= 0"),
    ("  encoder_cost:\n    linear: 0\n", None, r"data\.encoder_cost: coefficients: the terms .* are all 0"),
    ("  encoder_cost:\n    per_imag: 1.0\n", None, r"unknown key data\.encoder_cost\.per_imag"),
])
def test_a_bad_encoder_cost_is_refused_at_load_naming_the_config_and_the_key(
        tmp_path, monkeypatch, section, content, expected):
    assert_refused_at_load(tmp_path, monkeypatch, section, content, expected)


def test_the_flows_grouping_cuts_encoder_batches_by_the_configured_cost(tmp_path):
    """16 one-image samples of 64 patches under the default budget (1024 patches): 16 per
    batch by patches; when an image's fixed work costs 512 patches, a batch may cost
    1024 + 512 and holds 2 of them (2 * (64 + 512) <= 1536 < 3 * 576)."""
    cfg = load_config(write(tmp_path, "  encoder_cost:\n    per_image: 512.0\n"))
    metas = [SampleMeta(i, 0, 32, 16, (64,)) for i in range(16)]
    ranks = FlowRanks(1, 1, 1)
    by_patches = group_samples(metas, cfg, ranks, cfg.data.llm_cost_model())
    by_cost = group_samples(metas, cfg, ranks, cfg.data.llm_cost_model(), cfg.data.encoder_cost_model())
    assert [len(b) for b in by_patches.batches] == [16]
    assert [len(b) for b in by_cost.batches] == [2] * 8
    for grouping in (by_patches, by_cost):
        grouping.check(range(len(metas)))
