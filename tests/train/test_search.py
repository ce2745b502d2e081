"""``--search-baselines`` (train/search.py), in one process: the grid holds every baseline
family at every pipeline size the config allows (and every micro-batch size for the padded
baseline), nothing else changes between its runs, and the report gets each family's fastest
configuration under the family's name.  The grid's runs train like any run of the job
(tests/train/test_runs.py, test_e2e.py); a whole search was run by hand (docs/train.md)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from mindspeed_flow.train.config import load_config
from mindspeed_flow.train.metrics import RankRecord, RunRecord, StepOutcome
from mindspeed_flow.train.runs import catalogue
from mindspeed_flow.train.search import (
    MICRO_BATCH_SIZES,
    best_of_search,
    family_of,
    pipeline_sizes,
    search_grid,
    search_json,
    search_lines,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["ci.yaml", "demo.yaml"])
def cfg(request):
    return load_config(ROOT / "configs" / "train" / request.param)


def test_the_grid_is_every_family_at_every_pipeline_size_and_padded_micro_batch_size(cfg):
    sizes = pipeline_sizes(cfg)
    assert sizes == [p for p in (1, 2, 4) if p <= cfg.model.llm_layers]  # 4 ranks: the divisors the LLM can fill
    grid = search_grid(cfg)
    runs = catalogue(cfg)
    by_family: dict[str, list] = {}
    for spec in grid:
        by_family.setdefault(family_of(spec.name), []).append(spec)
        family = runs[family_of(spec.name)]
        assert spec.features == family.features and spec.kind == family.kind
        # only the layout's PP and the padded micro-batch size differ from the family's run
        same = dataclasses.replace(spec.cfg, layout=cfg.layout, data=cfg.data)
        assert same == cfg
    assert sorted((s.cfg.layout.baseline_pp, s.cfg.data.micro_batch_size) for s in by_family["baseline"]) == \
        sorted((p, m) for p in sizes for m in MICRO_BATCH_SIZES)
    for family in ("baseline-thd", "three-phase"):
        assert [s.cfg.layout.baseline_pp for s in by_family[family]] == sizes
        assert all(s.cfg.data == cfg.data for s in by_family[family])
    assert len({s.name for s in grid}) == len(grid) and all(family_of(n) is None for n in runs)


def _record(name: str, step_s: float) -> RunRecord:
    steps = [StepOutcome(step, 5.0, 8, 800, 800, step_s, []) for step in (1, 2, 3)]
    return RunRecord(name, f"{name} layout", 4, [], None, steps, [RankRecord.measure(0, "r0", 1.0, steps)], [], "cpu")


def test_the_best_configuration_of_each_family_is_reported_under_the_familys_name():
    grid = [_record("baseline@pp1-mbs1", 2.0), _record("baseline@pp2-mbs2", 1.0), _record("baseline@pp2-mbs4", 4.0),
            _record("three-phase@pp1", 1.0), _record("three-phase@pp2", 0.5)]
    best = best_of_search(grid)
    assert [r.name for r in best] == ["baseline", "three-phase"]
    assert best[0].layout == "baseline@pp2-mbs2 layout [best: pp2-mbs2]" and best[0].samples_per_s() == 8.0
    assert best[1].samples_per_s() == 16.0
    table = search_json(grid)
    assert table["baseline"]["best"] == "pp2-mbs2" and table["three-phase"]["best"] == "pp2"
    assert set(table["baseline"]["configs"]) == {"pp1-mbs1", "pp2-mbs2", "pp2-mbs4"}
    lines = search_lines(grid)
    assert "  baseline: pp1-mbs1 4.00 (0.50x), pp2-mbs2 8.00 (best), pp2-mbs4 2.00 (0.25x)" in lines


def test_the_command_line_runs_the_grid_and_flowtrain_without_parity_or_resume(cfg):
    from mindspeed_flow.train import cli
    from mindspeed_flow.train.job import Phases

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    phases = Phases.from_args(parser.parse_args(["train", "c.yaml", "--search-baselines"]))
    assert (phases.parity, phases.resume, phases.search) == (False, False, True)
    assert [s.name for s in phases.specs(cfg)] == [s.name for s in search_grid(cfg)] + ["flowtrain"]
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "c.yaml", "--search-baselines", "--ablation"])
