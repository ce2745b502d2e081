"""The paper-scale comparisons (configs/sim, scenarios) compare like with like: every
baseline gets its best split, the ViT costs what its devices make it cost, rows say how they
stand against DistTrain (Mpipe's own baseline), rendezvous beside eager, and the charts say
which simulated step they draw."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from mindspeed_flow.schedule import scenarios, simulate
from mindspeed_flow.schedule.scenarios import best_split, build_costs, format_table, load, run, scenario_plan
from tests.schedule.test_cli import SMALL as CLI_SMALL

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {p.stem: p for p in sorted((ROOT / "configs" / "sim").glob("*.yaml"))}

# the CLI tests' tiny config, with a split to search, the ViT's time given for one device
# and the public Mpipe code's order beside the ready one
SMALL = copy.deepcopy(CLI_SMALL)
SMALL["regions"]["vit"].update(forward_ms=[400, 600], forward_devices=1, spike_ms=2000)
SMALL["schedules"][0]["layers"] = "search"
SMALL["schedules"].insert(3, {"name": "prefix", "layout": "transpose", "transpose_order": "prefix", "stages": 2})


def _mean_step(config, schedule, semantics="eager"):
    plan = scenario_plan(config, schedule, semantics)
    steps = [simulate(plan, build_costs(config, schedule, s)).step_time for s in range(config["seeds"])]
    return sum(steps) / len(steps)


@pytest.fixture(scope="module")
def rows():
    return {r.name: r for r in run(SMALL)}


def test_the_megatron_baseline_gets_its_fastest_split():
    schedule = SMALL["schedules"][0]
    chosen = best_split(SMALL, schedule)["layers"]
    vit, llm = 4, 8
    candidates = [[vit + k, llm - k] for k in range(0, 5)]
    assert chosen in candidates
    steps = {tuple(c): _mean_step(SMALL, {**schedule, "layers": c}) for c in candidates}
    assert steps[tuple(chosen)] == min(steps.values())
    assert best_split(SMALL, {**schedule, "layers": [7, 5]})["layers"] == [7, 5]  # a given split stays


def test_rows_compare_with_the_disttrain_row_and_name_the_split(rows):
    assert rows["disttrain"].vs_disttrain == pytest.approx(1.0)
    for row in rows.values():
        assert row.vs_disttrain == pytest.approx(row.throughput / rows["disttrain"].throughput)
        assert row.speedup == pytest.approx(row.throughput / rows["megatron"].throughput)
    assert rows["megatron"].split is not None and sum(rows["megatron"].split) == 12
    table = format_table("tiny", list(rows.values()))
    assert "vs dist" in table.splitlines()[1]
    assert f"megatron layers {list(rows['megatron'].split)}" in table


def test_rendezvous_steps_are_reported_beside_the_eager_ones(rows):
    for schedule in SMALL["schedules"][1:]:
        row = rows[schedule["name"]]
        assert row.rendezvous == pytest.approx(_mean_step(SMALL, schedule, "rendezvous"))
        assert row.step == pytest.approx(_mean_step(SMALL, schedule))
    assert "rdv s" in format_table("tiny", list(rows.values())).splitlines()[1]


def test_charts_say_which_simulated_step_they_draw(tmp_path, monkeypatch, rows):
    titles = {}
    monkeypatch.setattr(scenarios, "draw", lambda result, path, title=None: titles.setdefault(Path(path).stem,
                                                                                          (title, result.step_time)))
    drawn = {r.name: r for r in run(SMALL, charts=tmp_path)}
    assert set(titles) == set(drawn)  # one chart per schedule
    for name, (title, step) in titles.items():
        assert "seed 0 of 2" in title
        assert f"table: mean {drawn[name].step:.2f} s" in title
    assert "means over 2 simulated steps" in format_table("tiny", list(drawn.values()))


def test_vit_time_scales_with_the_devices_that_run_it():
    config = copy.deepcopy(SMALL)
    one = build_costs(config, SMALL["schedules"][4], seed=0).nominal().regions["vit"].forward
    three = build_costs(config, {**SMALL["schedules"][4], "encoder_devices_per_rank": 3}, seed=0).nominal()
    assert three.regions["vit"].forward == pytest.approx(one / 3)
    # the shipped configs: one ViT, so more devices never make it slower
    def encoder_forward(stem):
        config = load(CONFIGS[stem])
        flow = next(s for s in config["schedules"] if s["name"] == "flowtrain")
        return build_costs(config, flow, seed=0).nominal().regions["vit"].forward, flow["encoder_devices_per_rank"]

    (t6, d6), (t72, d72) = encoder_forward("vlm_6b"), encoder_forward("vlm_72b")
    assert d72 > d6 and t72 < t6


@pytest.mark.parametrize("stem", sorted(CONFIGS))
def test_shipped_configs_store_what_their_formula_gives(stem):
    config = load(CONFIGS[stem])
    llm = config["regions"]["llm"]
    formula = 34 * config["tokens_per_microbatch"] * llm["hidden"] * llm["layers"] / config["devices_per_rank"]
    assert llm["stored_mb"] == round(formula / 2**20)


def test_the_encoder_time_figure_is_attributed_to_the_mpipe_seed_paper():
    texts = {p.name: p.read_text() for p in [*CONFIGS.values(), ROOT / "docs" / "schedule.md",
                                               ROOT / "mindspeed_flow" / "schedule" / "costs.py"]}
    for name, text in texts.items():
        for line in text.splitlines():
            if "200-300 ms" in line:
                assert "FlowTrain" not in line, f"{name}: {line.strip()}"
    assert "Mpipe seed paper" in texts["costs.py"]
    assert "Mpipe seed paper" in texts["schedule.md"]
