"""``data.llm_cost``: the flow's LLM cost model from the job's config (a calibrated JSON or
coefficients), checked at load with errors naming the file and the key, and the one the
flow's grouping (``train/stream.py``) fills the backbone's microbatches by."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from mindspeed_flow.flow import EncoderCost, FlowRanks, SampleMeta, group_step
from mindspeed_flow.packing import CostModel
from mindspeed_flow.train.config import ConfigError, load_config
from mindspeed_flow.train.stream import group_samples

# attention-heavy: one 600-token sample costs as much as 36 of 100 tokens (the default: ~7)
QUADRATIC_HEAVY = CostModel(linear=1e-6, quadratic=1e-3, encoder_linear=2e-4)
# one step's samples: default and attention-heavy costs fill the microbatches differently
LENGTHS = [600, 500, 400] + [100] * 7


def write(tmp_path, data_section: str, calibrated: object = None):
    """A config with ``data_section`` under ``data:`` (and ``cost_model.json`` when given)."""
    if calibrated is not None:
        (tmp_path / "cost_model.json").write_text(calibrated if isinstance(calibrated, str) else json.dumps(calibrated))
    path = tmp_path / "job.yaml"
    path.write_text(f"data:\n  capacity: 1024\n{data_section}")
    return path


def calibrated(model: CostModel) -> dict:
    """What ``scripts/calibrate_cost_model.py`` writes (its fit and a part of its evidence)."""
    return {"model": asdict(model), "r2": 0.99, "r2_held_out": 0.98, "observations": [[[512], 0.01]]}


def test_default_is_the_loaders_cost_model(tmp_path):
    cfg = load_config(write(tmp_path, ""))
    assert cfg.data.llm_cost_model() == CostModel(linear=1.0, quadratic=1.0 / 1024)


def test_coefficients_and_calibrated_file_load(tmp_path, monkeypatch):
    cfg = load_config(write(tmp_path, "  llm_cost:\n    linear: 2.0e-6\n    quadratic: 1.0e-3\n"))
    assert cfg.data.llm_cost_model() == CostModel(linear=2e-6, quadratic=1e-3)
    monkeypatch.chdir(tmp_path)  # the file is relative to the working directory, like data.path
    cfg = load_config(write(tmp_path, "  llm_cost:\n    file: cost_model.json\n", calibrated(QUADRATIC_HEAVY)))
    assert cfg.data.llm_cost_model() == QUADRATIC_HEAVY


@pytest.mark.parametrize("section, content, expected", [
    ("  llm_cost:\n    file: missing.json\n", None,
     r"data\.llm_cost\.file \(.*missing\.json\): cannot read the calibrated cost model"),
    ("  llm_cost:\n    file: cost_model.json\n", "{not json",
     r"data\.llm_cost\.file \(.*cost_model\.json\): not valid JSON"),
    ("  llm_cost:\n    file: cost_model.json\n", {"r2": 0.9},
     r"data\.llm_cost\.file \(.*cost_model\.json\): no 'model' mapping"),
    ("  llm_cost:\n    file: cost_model.json\n", {"model": {"linear": 1.0, "cubic": 2.0}},
     r"data\.llm_cost\.file \(.*\): unknown term model\.cubic"),
    ("  llm_cost:\n    file: cost_model.json\n", {"model": {"linear": -1.0, "quadratic": 1.0}},
     r"data\.llm_cost\.file \(.*\): CostModel\.linear must be >= 0"),
    ("  llm_cost:\n    file: cost_model.json\n", {"model": {"linear": "fast"}},
     r"data\.llm_cost\.file \(.*\): linear: expected a number, got str"),
    ("  llm_cost:\n    file: cost_model.json\n    quadratic: 1.0\n", calibrated(QUADRATIC_HEAVY),
     r"data\.llm_cost: set either file \(cost_model\.json\) or the coefficients"),
    ("  llm_cost:\n    linear: 0\n    quadratic: 0\n", None,
     r"data\.llm_cost: the LLM terms \(linear, quadratic, constant\) are all 0"),
    ("  llm_cost:\n    linaer: 1.0\n", None, r"unknown key data\.llm_cost\.linaer"),
])
def test_a_bad_llm_cost_is_refused_at_load_naming_the_config_the_key_and_the_file(
        tmp_path, monkeypatch, section, content, expected):
    assert_refused_at_load(tmp_path, monkeypatch, section, content, expected)


def assert_refused_at_load(tmp_path, monkeypatch, section: str, content: object, expected: str) -> None:
    """A config with ``section`` under ``data:`` (and ``content`` as ``cost_model.json``) is
    refused at load with a message that starts with the config's path and matches ``expected``."""
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, section, content)
    with pytest.raises(ConfigError, match=expected) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: ")


def test_the_flows_grouping_fills_microbatches_by_the_configured_cost(tmp_path, monkeypatch):
    """The same step grouped under the default and under a calibrated attention-heavy model
    (read from the config) gives different backbone microbatches, each the core's
    ``group_step`` under that model, every sample once."""
    monkeypatch.chdir(tmp_path)
    default = load_config(write(tmp_path, ""))
    heavy = load_config(write(tmp_path, "  llm_cost:\n    file: cost_model.json\n", calibrated(QUADRATIC_HEAVY)))
    metas = [SampleMeta(i, 0, n) for i, n in enumerate(LENGTHS)]
    ranks = FlowRanks(2, 1, 2)  # the demo's fallback layout: 2 ViT replicas, LLM PP=2 x DP=1
    by_default = group_samples(metas, default, ranks, default.data.llm_cost_model())
    by_heavy = group_samples(metas, heavy, ranks, heavy.data.llm_cost_model())
    assert by_heavy.microbatches != by_default.microbatches
    direct = group_step(metas, capacity=1024, llm_cost=QUADRATIC_HEAVY, encoder_cost=EncoderCost(linear=1.0),
                        encoder_budget=float(heavy.layout.flow_encoder_batch_patches), encoder_replicas=2, dp=1, pp=2)
    assert by_heavy.microbatches == direct.microbatches
    for grouping in (by_default, by_heavy):
        grouping.check(range(len(LENGTHS)))

