"""The three-phase co-located schedule (MindSpeed-MM's ``--hetero-parallel``, Megatron MIMO's
co-located step) as data: ``Transpose(order="phased")``.  The encoder's forwards over the
step, the LLM's 1F1B on their outputs, then the encoder's backwards: the plan validates, its
simulated step is the hand-computed sum of the three phases, and the phases do not overlap."""

from __future__ import annotations

import pytest

from mindspeed_flow.schedule import (
    CostTable,
    OneFOneB,
    Region,
    RegionCost,
    ScheduleError,
    Transpose,
    compose,
    simulate,
    validate,
)
from mindspeed_flow.schedule.gantt import draw
from mindspeed_flow.schedule.scenarios import build_regions


def three_phase(stages: int, trainable: bool = True) -> list[Region]:
    return [Region("vit", 2, Transpose(order="phased"), trainable=trainable),
            Region("llm", stages, OneFOneB(stages=stages))]


def costs(vit: float, llm_stage: float, stages: int) -> CostTable:
    """Free links; the LLM's whole-region forward is ``stages`` stages' time; backward 2x."""
    return CostTable({"vit": RegionCost(forward=vit), "llm": RegionCost(forward=llm_stage * stages)})


@pytest.mark.parametrize("semantics", ["eager", "rendezvous"])
@pytest.mark.parametrize("trainable", [True, False])
def test_the_plan_validates(semantics, trainable):
    plan = compose(three_phase(4, trainable), 8, semantics=semantics)
    validate(plan)
    assert plan.semantics == semantics


@pytest.mark.parametrize("stages, microbatches, vit, llm", [(4, 8, 1.5, 1.0), (2, 6, 0.5, 2.0), (3, 3, 2.0, 0.25)])
def test_the_simulated_step_is_the_sum_of_the_three_phases(stages, microbatches, vit, llm):
    result = simulate(compose(three_phase(stages), microbatches), costs(vit, llm, stages))
    owned = microbatches // stages  # each rank's share of the encoder's microbatches
    encoder_forward = owned * vit
    pipeline = (microbatches + stages - 1) * (llm + 2 * llm)  # 1F1B: (m + p - 1) (F + B)
    encoder_backward = owned * 2 * vit
    assert result.step_time == pytest.approx(encoder_forward + pipeline + encoder_backward)


def test_the_phases_do_not_overlap(tmp_path):
    result = simulate(compose(three_phase(4), 8), costs(1.5, 1.0, 4))
    spans = {(kind, region): [i for i in result.intervals
                              if i.action.kind.value == kind and i.action.region == region]
             for kind in "FB" for region in ("vit", "llm")}
    assert len(spans[("F", "vit")]) == len(spans[("B", "vit")]) == 8
    first_llm_forward = min(i.start for i in spans[("F", "llm")])
    last_llm_backward = max(i.end for i in spans[("B", "llm")])
    assert max(i.end for i in spans[("F", "vit")]) <= first_llm_forward
    assert min(i.start for i in spans[("B", "vit")]) >= last_llm_backward
    assert draw(result, tmp_path / "three_phase.png", "three-phase").is_file()


def test_options_it_cannot_take_are_refused():
    with pytest.raises(ScheduleError, match="max_in_flight"):
        Transpose(order="phased", max_in_flight=2)
    with pytest.raises(ScheduleError, match="recompute"):
        Transpose(order="phased", backward="recompute")


def test_the_simulator_layout_builds_it():
    config = {"regions": {"vit": {"layers": 2}, "llm": {"layers": 4}}}
    vit, llm = build_regions(config, {"name": "three-phase", "layout": "three-phase", "stages": 2})
    assert vit.skeleton == Transpose(order="phased")
    assert llm.skeleton == OneFOneB(stages=2)
