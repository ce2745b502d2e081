"""``mindspeed-flow simulate``: the subcommand registered on a plain argparse parser, and
the paper-scale configs shipped in configs/sim."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from mindspeed_flow.schedule.cli import register
from mindspeed_flow.schedule.scenarios import LAYOUTS, load, scenario_plan

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs" / "sim").glob("*.yaml"))

SMALL = {
    "name": "tiny",
    "devices": 32,
    "devices_per_rank": 2,
    "num_microbatches": 4,
    "seeds": 2,
    "link": {"latency_us": 10, "gb_per_s": 25},
    "packing_cv": {"unbalanced": 0.2, "balanced": 0.0},
    "regions": {
        "vit": {"layers": 4, "trainable": False, "forward_ms": [200, 300], "spike_prob": 0.1, "spike_ms": 1000},
        "llm": {"layers": 8, "forward_ms": 800, "output_mb": 8, "stored_mb": 1000},
    },
    "schedules": [
        {"name": "megatron", "layout": "megatron", "stages": 2, "layers": [7, 5]},
        {"name": "disttrain", "layout": "disttrain", "stages": 2},
        {"name": "transpose", "layout": "transpose", "stages": 2},
        {"name": "flow", "layout": "decoupled", "encoder_ranks": 1, "encoder_devices_per_rank": 1, "stages": 2},
    ],
}


def run_cli(argv):
    parser = argparse.ArgumentParser(prog="mindspeed-flow")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def write(tmp_path, config, name="tiny.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def test_simulate_prints_a_table_and_writes_charts(tmp_path, capsys):
    config = write(tmp_path, SMALL)
    assert run_cli(["simulate", str(config), "--charts", str(tmp_path / "charts")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"tiny ({config})"
    assert lines[1].split()[:5] == ["schedule", "layout", "pp", "mbs", "ranks"]
    rows = {line.split()[0]: line.split() for line in lines[3:7]}
    assert set(rows) == {"megatron", "disttrain", "transpose", "flow"}
    assert rows["megatron"][-2] == "1.00x"  # speedup over the first row; the last: vs disttrain
    assert rows["disttrain"][-1] == "1.00x"
    assert rows["flow"][2:6] == ["2", "1", "3", "5"]  # PP 2, 1 pack per microbatch, 3 ranks, 2 + 2 + 1 devices
    charts = sorted(p.name for p in (tmp_path / "charts" / "tiny").iterdir())
    assert charts == ["disttrain.png", "flow.png", "megatron.png", "transpose.png"]


def test_simulate_without_charts_and_with_fewer_seeds(tmp_path, capsys):
    config = write(tmp_path, SMALL)
    assert run_cli(["simulate", str(config), "--no-charts", "--seeds", "1", "--charts", str(tmp_path / "c")]) == 0
    assert not (tmp_path / "c").exists()
    assert "megatron" in capsys.readouterr().out


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda c: c["schedules"][0].update(layout="zigzag"), "layout 'zigzag' is not one of"),
        (lambda c: c["regions"].pop("llm"), "config: missing regions.llm"),
        (lambda c: c["schedules"][0].update(layers=[6, 5]), "sums to 11 but regions"),
    ],
)
def test_bad_configs_fail_with_the_fault_named(tmp_path, capsys, change, message):
    config = yaml.safe_load(yaml.safe_dump(SMALL))
    change(config)
    assert run_cli(["simulate", str(write(tmp_path, config)), "--no-charts"]) == 1
    assert message in capsys.readouterr().err


def test_the_mindspeed_flow_command_runs_simulate(tmp_path, capsys):
    from mindspeed_flow.cli import main

    assert main(["simulate", str(write(tmp_path, SMALL)), "--no-charts", "--seeds", "1"]) == 0
    assert "transpose" in capsys.readouterr().out


def test_missing_config_file(tmp_path, capsys):
    assert run_cli(["simulate", str(tmp_path / "nope.yaml")]) == 1
    assert "nope.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_compose_and_validate(path):
    config = load(path)
    layouts = {s["layout"] for s in config["schedules"]}
    assert layouts == set(LAYOUTS)  # every config compares all four layouts
    for schedule in config["schedules"]:
        plan = scenario_plan(config, schedule)  # a split to search is searched first
        assert [r.name for r in plan.regions] == ["vit", "llm"]
