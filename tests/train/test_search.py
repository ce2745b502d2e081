"""``--search-baselines`` (train/search.py), in one process: the grid holds every baseline
family at every pipeline size the config allows (and every micro-batch size for the padded
baseline), nothing else changes between its runs, and the report gets each family's fastest
configuration under the family's name and as the ``layout.best_*`` keys to paste.  One
small search runs end to end (2 ranks, 2 steps, CI model): the best of each family is the
fastest of the measured grid, in baseline_search.json, the report and best_baselines.yaml
(no timing is asserted); the demo's whole search was run by hand (docs/train.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from markers import requires_megatron_core
from mindspeed_flow.train.config import load_config
from mindspeed_flow.train.metrics import RankRecord, RunRecord, StepOutcome
from mindspeed_flow.train.runs import catalogue
from mindspeed_flow.train.search import (
    best_config_lines,
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
        sorted((p, m) for p in sizes for m in cfg.search.micro_batch_sizes)
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


def test_best_config_lines_are_the_layout_keys_of_each_familys_best(cfg, tmp_path):
    """The pasteable keys name each family's winning PP (and the padded baseline's micro-batch
    size), load as a config, and make the catalogue's baselines those configurations; the
    padded baseline's own configuration as its best means no second baseline run."""
    import yaml

    lay = cfg.layout
    other_mbs = next(m for m in (1, 2, 4) if m != cfg.data.micro_batch_size)
    grid = [_record(f"baseline@pp1-mbs{other_mbs}", 0.5), _record(f"baseline@pp{lay.baseline_pp}-mbs2", 1.0),
            _record("baseline-thd@pp1", 0.8), _record("baseline-thd@pp2", 0.4),
            _record("three-phase@pp1", 1.0), _record("three-phase@pp2", 2.0)]
    keys = yaml.safe_load("\n".join(best_config_lines(cfg, grid)))["layout"]
    assert keys == {"best_baseline_pp": 1, "best_baseline_micro_batch_size": other_mbs, "best_thd_pp": 2,
                    "best_three_phase_pp": 1}
    raw = yaml.safe_load((ROOT / "configs" / "train" / "ci.yaml").read_text())
    raw["layout"].update(keys)
    path = tmp_path / "best.yaml"
    path.write_text(yaml.safe_dump(raw))
    runs = catalogue(load_config(path))
    assert f"baseline-pp1-mbs{other_mbs}" in runs
    best = runs[f"baseline-pp1-mbs{other_mbs}"].cfg
    assert (best.layout.baseline_pp, best.data.micro_batch_size) == (1, other_mbs)
    assert (runs["baseline-thd"].cfg.layout.baseline_pp, runs["three-phase"].cfg.layout.baseline_pp) == (2, 1)
    # the configured baseline itself wins: no second baseline run
    grid[0] = _record(f"baseline@pp1-mbs{other_mbs}", 4.0)
    grid[1] = _record(f"baseline@pp{lay.baseline_pp}-mbs{cfg.data.micro_batch_size}", 1.0)
    keys = yaml.safe_load("\n".join(best_config_lines(cfg, grid)))["layout"]
    assert (keys["best_baseline_pp"], keys["best_baseline_micro_batch_size"]) == (None, None)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """``mindspeed-flow train --search-baselines`` on the CI config, made small: 2 ranks (PP 1
    and 2), 2 steps, the padded baseline at micro-batch sizes 1 and 2 (``search.micro_batch_sizes``):
    8 grid runs and flowtrain in one launch."""
    import yaml

    work = tmp_path_factory.mktemp("search_e2e")
    raw = yaml.safe_load((ROOT / "configs" / "train" / "ci.yaml").read_text())
    raw["data"].update(path=str(work / "demo_data"), samples=40)
    raw["layout"]["world_size"] = 2
    raw["search"] = {"micro_batch_sizes": [1, 2]}
    raw["steps"] = 2
    config = work / "search.yaml"
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    report = work / "report"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "train", str(config), "--search-baselines", "--report", str(report)],
                          cwd=work, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mindspeed-flow train --search-baselines failed ({proc.returncode}):\n{output[-6000:]}"
    return {"cfg": load_config(config), "config": raw, "report": report, "output": output,
            "search": json.loads((report / "baseline_search.json").read_text()),
            "metrics": json.loads((report / "metrics.json").read_text()),
            "keys": yaml.safe_load((report / "best_baselines.yaml").read_text())["layout"]}


@requires_megatron_core
def test_the_search_measures_the_grid_and_reports_each_familys_best(searched, tmp_path):
    """Every grid configuration trained and was measured; each family's best is the fastest of
    its measured configurations, in baseline_search.json, in the report under the family's
    name (flowtrain's ratio against it) and in the pasteable keys, which load as a config
    whose baselines are those configurations."""
    import yaml

    cfg, search, runs = searched["cfg"], searched["search"], searched["metrics"]["runs"]
    grid = search_grid(cfg)
    assert set(search) == {"baseline", "baseline-thd", "three-phase"}
    assert {(f, c) for f, entry in search.items() for c in entry["configs"]} == \
        {tuple(s.name.split("@")) for s in grid}
    assert set(search["baseline"]["configs"]) == {"pp1-mbs1", "pp1-mbs2", "pp2-mbs1", "pp2-mbs2"}
    flow = runs["flowtrain"]
    for family, entry in search.items():
        rates = {c: numbers["samples_per_s"] for c, numbers in entry["configs"].items()}
        assert all(rate > 0 for rate in rates.values())
        assert entry["best"] == max(rates, key=rates.get)
        record = runs[family]
        assert record["derived"]["samples_per_s"] == pytest.approx(rates[entry["best"]], rel=1e-9)
        assert record["record"]["layout"].endswith(f"[best: {entry['best']}]")
        assert flow["ratio_to"][family]["samples_per_s"] == pytest.approx(
            flow["derived"]["samples_per_s"] / rates[entry["best"]], rel=1e-9)
        assert f"  {family}: " in searched["output"] and f"{entry['best']} {rates[entry['best']]:.2f} (best)" in \
            searched["output"]
    assert not any("@" in name for name in runs)  # the grid's runs are in baseline_search.json only
    keys = searched["keys"]
    assert keys["best_thd_pp"] == search["baseline-thd"]["configs"][search["baseline-thd"]["best"]]["pp"]
    assert keys["best_three_phase_pp"] == search["three-phase"]["configs"][search["three-phase"]["best"]]["pp"]
    best = search["baseline"]["configs"][search["baseline"]["best"]]
    if (best["pp"], best["micro_batch_size"]) == (cfg.layout.baseline_pp, cfg.data.micro_batch_size):
        assert keys["best_baseline_pp"] is keys["best_baseline_micro_batch_size"] is None
    else:
        assert (keys["best_baseline_pp"], keys["best_baseline_micro_batch_size"]) == \
            (best["pp"], best["micro_batch_size"])
    assert "best_thd_pp:" in searched["output"]
    raw = searched["config"]
    raw["layout"].update(keys)
    path = tmp_path / "best.yaml"
    path.write_text(yaml.safe_dump(raw))
    catalogued = catalogue(load_config(path))
    assert catalogued["baseline-thd"].cfg.layout.baseline_pp == keys["best_thd_pp"]
    assert catalogued["three-phase"].cfg.layout.baseline_pp == keys["best_three_phase_pp"]
