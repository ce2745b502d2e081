"""Several flow steps as one plan (compose_flow_steps): a frozen encoder runs ahead into the
next step within its max_in_flight window, a trainable one stays within the step; the plans
validate sample by sample, the simulator shows the running ahead and charges per-sample
transfers by the sample's bytes."""

from __future__ import annotations

import dataclasses
import random

import pytest

from mindspeed_flow.flow import (EncoderCost, SampleMeta, StepNumbering, compose_flow, compose_flow_steps, flow_costs,
                                 group_step)
from mindspeed_flow.packing import CostModel
from mindspeed_flow.schedule import Kind, RegionCost, ScheduleError, simulate, validate
from mindspeed_flow.schedule.costs import Link
from mindspeed_flow.schedule.gantt import draw

LLM = CostModel(linear=1e-4, quadratic=2e-8, constant=1e-3)
ENCODER = EncoderCost(quadratic=4e-8, linear=2e-5, per_image=2e-4)  # the encoder is the faster side
LAYOUTS = [dict(encoder_replicas=2, pp=2, dp=1), dict(encoder_replicas=2, pp=1, dp=2)]


def steps(count=3, **layout):
    layout = {**LAYOUTS[0], **layout}
    out = []
    for k in range(count):
        rng = random.Random(k)
        samples = [SampleMeta(i, k, rng.randint(64, 900), 32, tuple(rng.choice([16, 64, 256, 1024])
                                                                    for _ in range(rng.randint(1, 2))))
                   for i in range(12)]
        out.append(group_step(samples, capacity=4096, llm_cost=LLM, encoder_cost=ENCODER, encoder_budget=0.004,
                              microbatches=4, **layout))
    return out


def costs(groupings, trainable, **kwargs):
    return flow_costs(groupings, llm_cost=LLM, encoder_cost=ENCODER,
                      encoder=RegionCost(input_grad_ratio=1.0 if trainable else 0.0), **kwargs)


def encoder_forwards(result, numbering, rank):
    """(step index, start, end) of rank's encoder forwards."""
    return [(numbering.step_of_group(iv.action.microbatch), iv.start, iv.end) for iv in result.intervals
            if iv.rank == rank and iv.action.kind is Kind.FORWARD]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["pp2xdp1", "pp1xdp2"])
@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "frozen"])
@pytest.mark.parametrize("window", [None, 1, 3])
def test_several_steps_validate_and_move_every_sample_of_every_step_once(layout, trainable, window):
    gs = steps(**layout)
    plan = compose_flow_steps(gs, trainable_encoder=trainable, max_in_flight=window)
    validate(plan)
    validate(plan, semantics="rendezvous")
    numbering = StepNumbering.of(gs)
    taken = [numbering.step_of_sample(a.sample) for r, p in plan.programs.items() if r >= 2 for a in p
             if a.kind is Kind.POOL_GET]
    assert sorted(taken) == sorted((k, s.sample_id) for k, g in enumerate(gs) for s in g.samples)
    assert len(plan.paths) == sum(len(g.batches) + len(g.microbatches) for g in gs)


def test_one_step_is_compose_flows_plan():
    g = steps(1)[0]
    assert compose_flow_steps([g], trainable_encoder=False) == compose_flow(g, trainable_encoder=False)


def test_a_frozen_encoder_runs_ahead_into_the_next_step_and_a_trainable_one_does_not(tmp_path):
    gs = steps()
    numbering = StepNumbering.of(gs)
    frozen = simulate(compose_flow_steps(gs, trainable_encoder=False), costs(gs, False))
    backbone_step0_end = max(iv.end for iv in frozen.intervals
                             if iv.rank >= 2 and numbering.step_of_group(iv.action.microbatch) == 0)
    for rank in (0, 1):
        next_step = [start for k, start, _ in encoder_forwards(frozen, numbering, rank) if k == 1]
        assert next_step and min(next_step) < backbone_step0_end
    trainable = simulate(compose_flow_steps(gs, trainable_encoder=True), costs(gs, True))
    for rank in (0, 1):
        backwards = [iv.end for iv in trainable.intervals if iv.rank == rank and iv.action.kind is Kind.BACKWARD
                     and numbering.step_of_group(iv.action.microbatch) == 0]
        assert min(start for k, start, _ in encoder_forwards(trainable, numbering, rank) if k == 1) >= max(backwards)
    path = draw(frozen, tmp_path / "steps.png", text=numbering.label)
    assert path.stat().st_size > 0


def test_the_window_waits_for_the_entry_max_in_flight_back_and_slows_a_fast_producer_only():
    gs = steps()
    window = 2
    plan = compose_flow_steps(gs, trainable_encoder=False, max_in_flight=window)
    for rank in (0, 1):
        program = plan.programs[rank]
        puts = [a.sample for a in program if a.kind is Kind.POOL_PUT]
        for i, a in enumerate(program):
            if a.kind is Kind.FORWARD:
                first = next(b.sample for b in program[i:] if b.kind is Kind.POOL_PUT)
                j = puts.index(first)
                waits = [b for b in program[max(0, i - 1):i] if b.carries is not None and b.carries.value == "taken"]
                assert [b.sample for b in waits] == ([puts[j - window]] if j >= window else [])
    free = simulate(compose_flow_steps(gs, trainable_encoder=False), costs(gs, False))
    bounded = simulate(plan, costs(gs, False))
    numbering = StepNumbering.of(gs)
    first_ahead = {name: min(start for rank in (0, 1) for k, start, _ in encoder_forwards(result, numbering, rank)
                             if k == 1) for name, result in (("free", free), ("bounded", bounded))}
    assert first_ahead["bounded"] > first_ahead["free"]
    assert bounded.step_time >= free.step_time


def test_a_taken_notice_before_its_get_is_refused_naming_it():
    gs = steps(2)
    plan = compose_flow_steps(gs, trainable_encoder=False, max_in_flight=1)
    rank = 2
    program = list(plan.programs[rank])
    i = next(i for i, a in enumerate(program) if a.carries is not None and a.carries.value == "taken")
    program.insert(i - 1, program.pop(i))
    broken = dataclasses.replace(plan, programs={**plan.programs, rank: tuple(program)})
    with pytest.raises(ScheduleError, match=rf"rank 2 action #{i - 1} .*was taken before its pool get"):
        validate(broken)


def test_per_sample_gets_cost_their_samples_bytes_plus_a_fixed_overhead():
    gs = steps(1)
    plan = compose_flow_steps(gs, trainable_encoder=False)
    g = gs[0]
    table = costs(gs, False, token_bytes=1000.0, pool=Link(latency=0.5, bandwidth=1e6))
    got = [a for a in plan.programs[2] if a.kind is Kind.POOL_GET]
    for a in got:
        assert table.transfer_seconds(a) == pytest.approx(0.5 + g.by_id[a.sample].image_tokens * 1000.0 / 1e6)
    big = dataclasses.replace(g, samples=tuple(dataclasses.replace(s, image_tokens=64, llm_tokens=s.llm_tokens + 32)
                                               if s.sample_id == got[0].sample else s for s in g.samples))
    dearer = costs([big], False, token_bytes=1000.0, pool=Link(latency=0.5, bandwidth=1e6))
    assert dearer.transfer_seconds(got[0]) > table.transfer_seconds(got[0])
    assert dearer.transfer_seconds(got[1]) == table.transfer_seconds(got[1])
