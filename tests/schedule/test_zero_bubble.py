"""Split backwards (I then W) and the zero-bubble skeletons built on them (issue 13)."""

from __future__ import annotations

import dataclasses

import pytest

from mindspeed_flow.schedule import (
    CostTable,
    Decoupled,
    Kind,
    OneFOneB,
    Region,
    RegionCost,
    ScheduleError,
    Transpose,
    ZeroBubbleH1,
    ZeroBubbleV,
    compose,
    simulate,
    validate,
)
from mindspeed_flow.schedule.actions import COMPUTE
from mindspeed_flow.schedule.gantt import draw
from mindspeed_flow.schedule.scenarios import build_regions, scenario_plan


def unit_costs(stages):
    """Per stage: forward 1, input gradients 1, weight gradients 1 (a whole B is 2)."""
    return CostTable({"llm": RegionCost(forward=float(stages), stored_bytes=1.0)})


def passes(plan, rank):
    return [f"{a.kind.value}{a.microbatch}" for a in plan.programs[rank] if a.kind in COMPUTE]


def test_trainable_regions_split_their_backward_and_frozen_ones_keep_input_gradients_only():
    plan = compose([Region("vit", 2, Decoupled(ranks=1), trainable=False),
                    Region("proj", 1, ZeroBubbleH1(stages=2), trainable=True),
                    Region("llm", 4, ZeroBubbleH1(stages=2), trainable=False)], 2)
    kinds = {(a.region, a.kind) for p in plan.programs.values() for a in p if a.kind in COMPUTE}
    assert kinds == {("vit", Kind.FORWARD), ("proj", Kind.FORWARD), ("llm", Kind.FORWARD),
                     ("proj", Kind.BACKWARD_INPUT), ("proj", Kind.BACKWARD_WEIGHT),
                     ("llm", Kind.BACKWARD_INPUT)}
    validate(plan)


def test_zb_h1_order_and_closed_form():
    stages, microbatches = 4, 8
    plan = compose([Region("llm", 8, ZeroBubbleH1(stages=stages))], microbatches)
    # 1F1B's warm-up; stage s holds back its first s weight steps
    assert passes(plan, 0)[:8] == ["F0", "F1", "F2", "F3", "I0", "W0", "F4", "I1"]
    assert passes(plan, 3)[:9] == ["F0", "I0", "F1", "I1", "F2", "I2", "F3", "I3", "W0"]
    assert passes(plan, 3)[-3:] == ["W5", "W6", "W7"]
    for semantics in ("eager", "rendezvous"):
        validate(compose([Region("llm", 8, ZeroBubbleH1(stages=stages))], microbatches, semantics=semantics))
    result = simulate(plan, unit_costs(stages))
    baseline = simulate(compose([Region("llm", 8, OneFOneB(stages=stages))], microbatches), unit_costs(stages))
    assert baseline.step_time == pytest.approx(3 * (microbatches + stages - 1))
    assert result.step_time == pytest.approx(3 * microbatches + stages - 1)
    assert result.peak_live == {r: stages for r in range(stages)}  # 1F1B's stage-0 peak
    intervals = {(iv.rank, iv.action.kind, iv.action.microbatch): iv.end - iv.start for iv in result.intervals}
    assert intervals[(0, Kind.BACKWARD_INPUT, 0)] == pytest.approx(1.0)
    assert intervals[(0, Kind.BACKWARD_WEIGHT, 0)] == pytest.approx(1.0)


def test_v_shape_puts_the_loss_on_rank_zero_and_beats_zb_h1():
    stages, microbatches = 4, 8
    plan = compose([Region("llm", 16, ZeroBubbleV(stages=stages))], microbatches)
    assert plan.roles == {0: "llm.s0 + llm.s7", 1: "llm.s1 + llm.s6", 2: "llm.s2 + llm.s5", 3: "llm.s3 + llm.s4"}
    assert [(v.stage, v.rank) for v in plan.paths[0]] == [(0, 0), (1, 1), (2, 2), (3, 3), (4, 3), (5, 2), (6, 1), (7, 0)]
    validate(plan)
    validate(compose([Region("llm", 16, ZeroBubbleV(stages=stages))], microbatches, semantics="rendezvous"))
    v_shape = simulate(plan, unit_costs(stages))
    h1 = simulate(compose([Region("llm", 16, ZeroBubbleH1(stages=stages))], microbatches), unit_costs(stages))
    one = simulate(compose([Region("llm", 16, OneFOneB(stages=stages))], microbatches), unit_costs(stages))
    assert v_shape.step_time < h1.step_time < one.step_time
    assert max(v_shape.peak_bytes.values()) <= max(one.peak_bytes.values())


def test_a_v_shape_does_not_extend_another_pipeline():
    with pytest.raises(ScheduleError, match="pipeline can be extended only by the same non-interleaved order"):
        compose([Region("vit", 2, ZeroBubbleV(stages=1)), Region("llm", 4, ZeroBubbleV(stages=2))], 2)


def test_transpose_on_zb_h1_composes_validates_and_simulates(tmp_path):
    regions = [Region("vit", 2, Transpose(max_in_flight=4)), Region("llm", 8, ZeroBubbleH1(stages=4))]
    costs = CostTable({"vit": RegionCost(forward=0.5, param_bytes=1e6), "llm": RegionCost(forward=4.0)})
    for semantics in ("eager", "rendezvous"):
        plan = compose(regions, 8, semantics=semantics)
        validate(plan)
    zb = simulate(compose(regions, 8), costs)
    plain = simulate(compose([regions[0], Region("llm", 8, OneFOneB(stages=4))], 8), costs)
    assert zb.step_time < plain.step_time
    pytest.importorskip("matplotlib")
    assert draw(zb, tmp_path / "zb.png").read_bytes()[:4] == b"\x89PNG"


def test_scenarios_name_the_backbone():
    config = {
        "devices_per_rank": 1, "num_microbatches": 4, "packing_cv": {"unbalanced": 0.0},
        "regions": {"vit": {"layers": 2, "forward_ms": 100}, "llm": {"layers": 8, "forward_ms": 400}},
    }
    schedule = {"name": "zb", "layout": "transpose", "backbone": "zb-h1", "stages": 2}
    assert isinstance(build_regions(config, schedule)[1].skeleton, ZeroBubbleH1)
    assert any(a.kind is Kind.BACKWARD_WEIGHT for a in scenario_plan(config, schedule).programs[0])
    with pytest.raises(ScheduleError, match=r"backbone 'zb-h2' is not one of \('1f1b', 'zb-h1', 'zb-v'\)"):
        build_regions(config, {**schedule, "backbone": "zb-h2"})


def test_the_validator_knows_the_weight_step_needs_the_input_step():
    plan = compose([Region("llm", 4, ZeroBubbleH1(stages=2))], 2)
    program = list(plan.programs[1])
    i = next(i for i, a in enumerate(program) if a.kind is Kind.BACKWARD_INPUT and a.microbatch == 0)
    j = next(i for i, a in enumerate(program) if a.kind is Kind.BACKWARD_WEIGHT and a.microbatch == 0)
    program[i], program[j] = program[j], program[i]
    with pytest.raises(ScheduleError, match=r"rank 1 action #\d+ `W      llm.s1 mb0`: needs input-gradient backward of mb0"):
        validate(dataclasses.replace(plan, programs={**plan.programs, 1: tuple(program)}))
    del program[i]
    with pytest.raises(ScheduleError, match=r"W llm.s1 mb0 runs 0 times on rank 1, expected once"):
        validate(dataclasses.replace(plan, programs={**plan.programs, 1: tuple(program)}))
