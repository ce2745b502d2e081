"""The flow's encoder cost from ``scripts/calibrate_cost_model.py``: the script's encoder calls
identify all three terms, the ``encoder_cost`` mapping it writes loads back, and a file or
terms that cannot be a cost are refused naming the file and the key; a budget in patches is
one image of that many patches under the cost."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from mindspeed_flow.flow import EncoderCost, SampleMeta
from mindspeed_flow.flow.encoder_cost import CALIBRATION_KEY, PATCHES
from mindspeed_flow.flow.errors import EncoderCostError

from tests.support.scripts import import_script

TRUTH = EncoderCost(quadratic=3e-8, linear=2.5e-5, per_image=1.5e-4)


@pytest.fixture(scope="module")
def calibrate():
    """``scripts/calibrate_cost_model.py`` as a module (its call shapes and their conversion)."""
    return import_script("calibrate_cost_model")


def test_the_scripts_calls_fit_every_term_and_its_json_loads_back(calibrate, tmp_path):
    images = [(patches, TRUTH.cost([SampleMeta(0, 0, 1, 0, tuple(patches))])) for patches in calibrate.IMAGE_SETS]
    fitted = EncoderCost.fit(calibrate.encoder_calls(images))
    for name in ("quadratic", "linear", "per_image"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUTH, name), rel=1e-6)
    path = tmp_path / "cost_model.json"
    path.write_text(json.dumps({"model": {"linear": 1.0}, CALIBRATION_KEY: asdict(fitted), "r2_encoder_cost": 1.0}))
    assert EncoderCost.load(path) == fitted


@pytest.mark.parametrize("content, expected", [
    (None, r"missing\.json: cannot read the calibrated cost model"),
    ("{not json", r"cost\.json: not valid JSON"),
    ({"model": {"linear": 1.0}}, r"cost\.json: no 'encoder_cost' mapping"),
    ({CALIBRATION_KEY: {"linear": 1.0, "cubic": 2.0}}, r"cost\.json: unknown term encoder_cost\.cubic"),
    ({CALIBRATION_KEY: {"linear": -1.0}}, r"cost\.json: encoder_cost: linear must be >= 0, got -1\.0"),
    ({CALIBRATION_KEY: {"linear": "fast"}}, r"cost\.json: encoder_cost: linear: expected a number, got str"),
    ({CALIBRATION_KEY: {"linear": 0, "per_image": 0}}, r"cost\.json: encoder_cost: the terms .* are all 0"),
])
def test_a_file_that_is_no_encoder_cost_is_refused_naming_it_and_the_key(tmp_path, content, expected):
    path = tmp_path / ("missing.json" if content is None else "cost.json")
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(EncoderCostError, match=expected):
        EncoderCost.load(path)


def test_a_budget_in_patches_is_one_image_of_that_many_patches():
    assert PATCHES.image_cost(1024) == 1024.0  # the default: the budget is patches, as before
    budget = TRUTH.image_cost(1024)
    assert budget == pytest.approx(TRUTH.cost([SampleMeta(0, 0, 1, 0, (1024,))]))
    # under the fitted cost, 1024 patches cut into 16 images cost less than one image of 1024
    # (attention is per image) and 1024 patches cut into 256 images cost more (per-image work)
    assert TRUTH.cost([SampleMeta(0, 0, 1, 0, (64,) * 16)]) < budget < TRUTH.cost([SampleMeta(0, 0, 1, 0, (4,) * 256)])
