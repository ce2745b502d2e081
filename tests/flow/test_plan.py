"""One flow step as a schedule plan: it validates sample by sample, broken plans are refused
naming the action, the simulator charges each group its samples' costs, and the runtime
refuses it."""

from __future__ import annotations

import dataclasses
import random

import pytest

from mindspeed_flow.flow import EncoderCost, SampleMeta, compose_flow, flow_costs, group_seconds, group_step
from mindspeed_flow.packing import CostModel
from mindspeed_flow.runtime import Executor
from mindspeed_flow.schedule import Action, Kind, RegionCost, ScheduleError, simulate, validate
from mindspeed_flow.schedule.gantt import draw
from mindspeed_flow.schedule.seams import FLOW

LLM = CostModel(linear=1e-4, quadratic=2e-8, constant=1e-3)
ENCODER = EncoderCost(quadratic=4e-8, linear=1e-4, per_image=2e-3)
LAYOUTS = [dict(encoder_replicas=2, pp=2, dp=1), dict(encoder_replicas=2, pp=1, dp=2)]


def step_samples(n=16, seed=0):
    rng = random.Random(seed)
    return [SampleMeta(i, 0, rng.randint(64, 900), 32, tuple(rng.choice([16, 64, 256, 1024, 2048])
                                                              for _ in range(rng.randint(1, 2))))
            for i in range(n)]


def grouping(samples=None, **layout):
    layout = {**LAYOUTS[0], **layout}
    return group_step(samples or step_samples(), capacity=4096, llm_cost=LLM, encoder_cost=ENCODER,
                      encoder_budget=0.01, microbatches=4, **layout)


def edited(plan, rank, edit):
    program = list(plan.programs[rank])
    edit(program)
    return dataclasses.replace(plan, programs={**plan.programs, rank: tuple(program)})


def index_of(plan, rank, predicate):
    return next(i for i, a in enumerate(plan.programs[rank]) if predicate(a))


def moved(plan, rank, source, target):
    """The plan with rank's action ``source`` moved to position ``target``."""
    return edited(plan, rank, lambda program: program.insert(target, program.pop(source)))


@pytest.mark.parametrize("layout", LAYOUTS, ids=["pp2xdp1", "pp1xdp2"])
@pytest.mark.parametrize("trainable", [True, False], ids=["trainable", "frozen"])
def test_a_composed_flow_plan_validates_and_moves_every_sample_once(layout, trainable):
    g = grouping(**layout)
    plan = compose_flow(g, trainable_encoder=trainable)
    validate(plan)
    validate(plan, semantics="rendezvous")
    encoders = range(g.encoder_replicas)
    gets = [a.sample for r, p in plan.programs.items() if r not in encoders for a in p if a.kind is Kind.POOL_GET]
    assert sorted(gets) == sorted(s.sample_id for s in g.samples)
    grads = [a.sample for r in encoders for a in plan.programs[r] if a.kind is Kind.POOL_GET]
    assert sorted(grads) == (sorted(gets) if trainable else [])
    # the backbone's first stages take their input through the flow seam, by sample
    assert {path[0].inbound for path in plan.paths[len(g.batches):]} == {FLOW}
    assert plan.num_microbatches == len(g.batches) + len(g.microbatches)


def test_sample_actions_print_and_read_back():
    plan = compose_flow(grouping())
    for program in plan.programs.values():
        for a in program:
            assert Action.from_str(str(a)) == a
    put = next(a for a in plan.programs[0] if a.kind is Kind.POOL_PUT)
    assert f" smp{put.sample} " in str(put)


# (rank, the action moved, where it goes, the refusal: {sample} is the moved action's sample)
MISORDERED = {
    "get after the forward that needs it": (
        2, Kind.POOL_GET, Kind.FORWARD, r"`F +llm.s0 mb\d+`: needs act of smp{sample} earlier on this rank"),
    "put before the forward that makes it": (
        0, Kind.POOL_PUT, Kind.FORWARD,
        r"`PUT +vit.s0 mb\d+ smp{sample} -> r2 \[vit.s0:act\]`: puts act of smp{sample} before its group's forward"),
    "encoder backward before its gradients": (
        0, Kind.POOL_GET, Kind.BACKWARD, r"`B +vit.s0 mb\d+`: needs grad of smp{sample} earlier on this rank"),
    "gradient put before the backbone's backward": (
        2, Kind.POOL_PUT, Kind.BACKWARD,
        r"`PUT +llm.s0 mb\d+ smp{sample} -> r\d \[vit.s0:grad\]`: puts grad of smp{sample} before its backward"),
}


@pytest.mark.parametrize("case", MISORDERED, ids=list(MISORDERED))
def test_a_misordered_sample_transfer_is_refused_naming_the_action(case):
    """The rank's first action of one kind swaps sides with its first compute of another:
    a get moves after the compute, a put before it."""
    rank, transfer, compute, refusal = MISORDERED[case]
    plan = compose_flow(grouping())
    source = index_of(plan, rank, lambda a: a.kind is transfer)
    target = index_of(plan, rank, lambda a: a.kind is compute)
    broken = moved(plan, rank, source, target)
    with pytest.raises(ScheduleError, match=rf"rank {rank} action #\d+ " + refusal.format(
            sample=plan.programs[rank][source].sample)):
        validate(broken)


def test_a_sample_taken_by_nobody_or_twice_is_refused():
    plan = compose_flow(grouping())
    get = index_of(plan, 2, lambda a: a.kind is Kind.POOL_GET)
    sample = plan.programs[2][get].sample
    missing = edited(plan, 2, lambda program: program.pop(get))
    with pytest.raises(ScheduleError, match=rf"`PUT +vit.s0 mb\d+ smp{sample} -> r2 \[vit.s0:act\]` is never "
                                            "taken from the pool"):
        validate(missing)
    twice = edited(plan, 2, lambda program: program.insert(get, program[get]))
    with pytest.raises(ScheduleError, match=rf"\[vit.s0:act\] smp{sample} is pooled twice"):
        validate(twice)
    microbatch = plan.programs[2][get].microbatch
    other = dataclasses.replace(plan, samples={**plan.samples, microbatch + 1: plan.samples[microbatch + 1]
                                               + (sample,)})
    with pytest.raises(ScheduleError,
                       match=rf"smp{sample} is in consumer groups mb{microbatch} and mb{microbatch + 1}"):
        validate(other)


def test_simulation_charges_each_group_its_samples_costs(tmp_path):
    g = grouping()
    plan = compose_flow(g)
    costs = flow_costs(g, llm_cost=LLM, encoder_cost=ENCODER, encoder=RegionCost(backward_ratio=2.0),
                       backbone=RegionCost(backward_ratio=2.0))
    result = simulate(plan, costs)
    seconds = group_seconds(g, LLM, ENCODER)
    for e in range(g.encoder_replicas):  # forward + backward (2x) of each batch
        assert result.busy[e] == pytest.approx(3 * sum(seconds[b] for b in g.replica_batches(e)))
    offset = len(g.batches)
    for stage in (2, 3):  # each of the 2 stages holds half the backbone
        assert result.busy[stage] == pytest.approx(1.5 * sum(seconds[offset:]))
    # a bigger image on one sample costs its encoder batch, and only that one, more
    heavier = [dataclasses.replace(s, patches=(4096,)) if s.sample_id == g.batches[0][0] else s for s in g.samples]
    g2 = dataclasses.replace(g, samples=tuple(heavier))
    more = group_seconds(g2, LLM, ENCODER)
    assert more[0] > seconds[0] and more[1:] == seconds[1:]
    assert simulate(compose_flow(g2), flow_costs(g2, llm_cost=LLM, encoder_cost=ENCODER)).busy[
        g.batch_replica[0]] > simulate(plan, flow_costs(g, llm_cost=LLM, encoder_cost=ENCODER)).busy[g.batch_replica[0]]
    chart = draw(result, tmp_path / "flow.png", title="flow")
    assert chart.stat().st_size > 0


def test_the_executor_refuses_a_flow_plan():
    plan = compose_flow(grouping())
    executor = Executor(2, ranks=list(range(len(plan.programs))), store=None)  # BCAST #0, F #1, PUT #2 on r0
    with pytest.raises(ScheduleError, match=r"r0 #2 PUT vit.s0 mb\d+ smp\d+ -> r2 \[vit.s0:act\]: a flow plan "
                                            r"\(per-sample pool transfers\) cannot run in the runtime yet"):
        executor.prepare(plan)
