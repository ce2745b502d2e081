"""``decoupled.flow_encoder_cost``: the encoder's batch cost under the flow, read from a
calibration JSON (relative to the layout file) or written inline, refused naming the layout
file and the key; unset, the encoder's batches are cut by patches as before, and the budget
``flow_encoder_batch_patches`` is one image of that many patches under the cost."""

from __future__ import annotations

import json

import pytest

from mindspeed_flow.decoupled import DecoupledLayout, LayoutError
from mindspeed_flow.flow import EncoderCost, SampleMeta
from mindspeed_flow.flow.encoder_cost import PATCHES
from mindspeed_flow.flow.packed import group_packed
from mindspeed_flow.runtime.layout import load_decoupled
from mindspeed_flow.schedule import ScheduleError

SECTION = "decoupled:\n  encoder: {dp: 1}\n  backbone: {pp: 2}\n  flow: true\n  flow_encoder_batch_patches: 64\n"
PER_IMAGE_HEAVY = EncoderCost(linear=1.0, per_image=64.0)  # one image's fixed work costs 64 patches


def layout(tmp_path, extra: str = ""):
    path = tmp_path / "layout.yaml"
    path.write_text(SECTION + extra)
    return load_decoupled(path)


def test_unset_is_patches_and_the_budget_is_the_patch_count(tmp_path):
    default = layout(tmp_path)
    assert default.flow_encoder_cost is None and default.flow_encoder_model == PATCHES
    assert default.flow_encoder_budget == 64.0


def test_a_calibration_file_next_to_the_layout_and_inline_terms_are_read(tmp_path):
    (tmp_path / "cost_model.json").write_text(json.dumps({"model": {}, "encoder_cost": {
        "quadratic": 0.0, "linear": 1.0, "per_image": 64.0}}))
    from_file = layout(tmp_path, "  flow_encoder_cost: cost_model.json\n")
    inline = layout(tmp_path, "  flow_encoder_cost: {linear: 1.0, per_image: 64.0}\n")
    assert from_file == inline and inline.flow_encoder_cost == PER_IMAGE_HEAVY
    assert inline.flow_encoder_budget == 64.0 + 64.0  # one image of 64 patches under the cost


def test_the_budget_rule_cuts_other_batches_than_patches():
    """16 one-image samples of 16 patches: by patches 4 fit a 64-patch batch; when an image's
    fixed work costs 64 patches, 128 (one image of 64 patches) holds 1 of them."""
    metas = [SampleMeta(i, 0, 8, 4, (16,)) for i in range(16)]
    microbatches = [list(range(i, i + 4)) for i in range(0, 16, 4)]
    cut = {}
    for name, lay in (("patches", DecoupledLayout(flow=True, flow_encoder_batch_patches=64)),
                      ("heavy", DecoupledLayout(flow=True, flow_encoder_batch_patches=64,
                                                flow_encoder_cost=PER_IMAGE_HEAVY))):
        cut[name] = group_packed(metas, microbatches, encoder_cost=lay.flow_encoder_model,
                                 encoder_budget=lay.flow_encoder_budget, encoder_replicas=1, pp=2).batches
    assert [len(b) for b in cut["patches"]] == [4] * 4
    assert [len(b) for b in cut["heavy"]] == [1] * 16


@pytest.mark.parametrize("extra, message", [
    ("  flow_encoder_cost: missing.json\n", "missing.json: cannot read the calibrated cost model"),
    ("  flow_encoder_cost: {linear: 1.0, cubic: 2.0}\n", "unknown term cubic"),
    ("  flow_encoder_cost: {linear: -1.0}\n", "linear must be >= 0, got -1.0"),
    ("  flow_encoder_cost: {linear: 0, per_image: 0}\n", "are all 0"),
    ("  flow_encoder_cost: 3\n", "expected a mapping of quadratic, linear, per_image, got int 3"),
])
def test_a_bad_flow_encoder_cost_is_refused_naming_the_file_and_the_key(tmp_path, extra, message):
    with pytest.raises(ScheduleError) as refused:
        layout(tmp_path, extra)
    assert str(refused.value).startswith(f"{tmp_path / 'layout.yaml'}: decoupled.flow_encoder_cost: ")
    assert message in str(refused.value)


def test_a_cost_that_prices_the_budget_image_at_nothing_is_refused():
    with pytest.raises(LayoutError, match="no budget to cut the encoder's batches by"):
        DecoupledLayout(flow=True, flow_encoder_cost=EncoderCost())
