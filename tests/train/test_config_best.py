"""The ``layout.best_*`` keys (each baseline at its best, set from ``--search-baselines``) and
the ``search`` section: bad values are refused at load naming the file and the key, and the
runs they choose are the baselines at those configurations, nothing else changed."""

from __future__ import annotations

import dataclasses

import pytest

from mindspeed_flow.train.config import ConfigError, load_config
from mindspeed_flow.train.runs import catalogue


@pytest.mark.parametrize("text, message", [
    ("layout:\n  best_thd_pp: 3\n", r"layout\.best_thd_pp: 3 is not a pipeline size .* \[1, 2, 4\]"),
    ("layout:\n  best_three_phase_pp: 4\nmodel:\n  llm_layers: 2\n",
     r"layout\.best_three_phase_pp: 4 is not a pipeline size .*model\.llm_layers 2: \[1, 2\]"),
    ("layout:\n  best_thd_pp: two\n", r"layout\.best_thd_pp: expected int, got str 'two'"),
    ("layout:\n  best_baseline_micro_batch_size: 0\n", r"layout\.best_baseline_micro_batch_size: must be >= 1"),
    ("layout:\n  best_baseline_micro_batch_size: 2\n",
     r"layout\.best_baseline_micro_batch_size: 2 is data\.micro_batch_size already and layout\.best_baseline_pp is null"),
    ("layout:\n  best_baseline_pp: 2\n  best_baseline_micro_batch_size: 2\n",
     r"layout\.best_baseline_pp: 2 is layout\.baseline_pp already"),
    ("search:\n  pp: [1, 3]\n", r"search\.pp: \[3\] are not pipeline sizes a co-located run can take here"),
    ("search:\n  pp: []\n", r"search\.pp: must be a non-empty list without repeats"),
    ("search:\n  micro_batch_sizes: [2, 2]\n", r"search\.micro_batch_sizes: must be a non-empty list without repeats"),
    ("search:\n  micro_batch_sizes: [0]\n", r"search\.micro_batch_sizes: \[0\] are not sizes >= 1"),
    ("search:\n  size: 1\n", r"unknown key search\.size \(known in search: pp, micro_batch_sizes\)"),
])
def test_best_and_search_keys_are_checked_at_load(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_the_best_keys_choose_each_baselines_configuration_and_nothing_else(tmp_path):
    path = tmp_path / "best.yaml"
    path.write_text("layout:\n  baseline_pp: 2\n  best_baseline_micro_batch_size: 4\n  best_thd_pp: 1\n"
                    "  best_three_phase_pp: 4\n")
    cfg = load_config(path)
    runs = catalogue(cfg)
    best = runs["baseline-pp2-mbs4"].cfg  # the baseline's PP, its own micro-batch size
    assert (best.layout.baseline_pp, best.data.micro_batch_size) == (2, 4)
    assert dataclasses.replace(best.data, micro_batch_size=cfg.data.micro_batch_size) == cfg.data
    assert runs["baseline-thd"].cfg.layout.baseline_pp == 1 and runs["baseline-thd"].cfg.baseline_dp == 4
    assert runs["three-phase"].cfg.layout.baseline_pp == 4 and runs["three-phase"].cfg.baseline_dp == 1
    for name in ("baseline-pp2-mbs4", "baseline-thd", "three-phase"):
        resolved = runs[name].cfg
        assert (resolved.model, resolved.optim, resolved.seed, resolved.steps) == (cfg.model, cfg.optim, cfg.seed,
                                                                                 cfg.steps)
        assert resolved.layout.best_thd_pp is resolved.layout.best_baseline_micro_batch_size is None
    # the chain and the configured baseline keep baseline_pp and data.micro_batch_size
    assert runs["baseline"].cfg == runs["conv-matmul"].cfg == cfg
    path.write_text("layout:\n  best_thd_pp: null\n  best_three_phase_pp: null\n")
    cfg = load_config(path)
    assert catalogue(cfg)["baseline-thd"].cfg.layout.baseline_pp == cfg.layout.baseline_pp
    assert cfg.best_baseline() is None
