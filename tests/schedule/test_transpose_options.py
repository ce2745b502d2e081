"""Transpose's two orders and two backward placements, as the public Mpipe code
(``ScheduleMPipeTranspose`` in mindspore-ai/hyper-parallel) runs them: a prefix of every
owned forward then one block of sends, and the trainable region's backward recomputed on
the pipeline's first stage (no reduce) or run by the owner (feature gradients back, reduce)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from mindspeed_flow.schedule import (
    CostTable,
    GPipe,
    Interleaved1F1B,
    Kind,
    OneFOneB,
    Region,
    RegionCost,
    ScheduleError,
    Transpose,
    compose,
    simulate,
    validate,
)
from mindspeed_flow.schedule.actions import COMPUTE
from mindspeed_flow.schedule.zero_bubble import ZeroBubbleH1

STAGES, MICROBATCHES = 4, 8


def vlm(trainable=True, backbone=None, **options):
    return [Region("vit", 2, Transpose(**options), trainable=trainable),
            Region("llm", 8, backbone or OneFOneB(stages=STAGES))]


def computes(plan, rank, region=None):
    return [(a.kind.value, a.region, a.microbatch) for a in plan.programs[rank]
            if a.kind in COMPUTE and region in (None, a.region)]


def owned(rank):
    return list(range(rank, MICROBATCHES, STAGES))


def test_prefix_runs_every_owned_forward_then_one_block_of_sends():
    plan = compose(vlm(trainable=False, order="prefix"), MICROBATCHES)
    plain = compose(vlm(trainable=False), MICROBATCHES)
    for rank, program in plan.programs.items():
        prefix = [("F", "vit", m) for m in owned(rank)]
        assert computes(plan, rank)[: len(prefix)] == prefix
        # the pipeline's own order is the skeleton's, untouched
        assert computes(plan, rank, "llm") == computes(plain, rank, "llm")
        block = program[len(prefix): len(prefix) + MICROBATCHES - len(owned(0))]
        if rank:
            assert [(a.kind, a.peer, a.key, a.microbatch) for a in block[: len(prefix)]] == [
                (Kind.SEND_ACT, 0, "vit.s0:act", m) for m in owned(rank)]
        else:  # the first stage takes every other rank's features in one block
            others = sorted(set(range(MICROBATCHES)) - set(owned(0)))
            assert [(a.kind, a.key, a.microbatch) for a in block] == [
                (Kind.RECV_ACT, "vit.s0:act", m) for m in others]
    validate(plan)


def test_recompute_ships_the_input_and_runs_every_backward_on_the_first_stage():
    plan = compose(vlm(order="prefix", backward="recompute"), MICROBATCHES)
    programs = plan.programs
    for rank in range(1, STAGES):
        assert not [a for a in computes(plan, rank, "vit") if a[0] != "F"]  # owners keep nothing
        inputs = [(a.microbatch, a.peer) for a in programs[rank] if a.key == "vit.s0:input"]
        assert inputs == [(m, 0) for m in owned(rank)]
        assert not any(a.kind is Kind.RECV_GRAD and a.region == "vit" for a in programs[rank])
    first = computes(plan, 0)
    for m in range(MICROBATCHES):  # each right after the first stage's backward of m
        assert first[first.index(("B", "llm", m)) + 1] == ("B", "vit", m)
    kinds = [a.kind for p in programs.values() for a in p]
    assert Kind.PARAM_BROADCAST in kinds and Kind.GRAD_REDUCE not in kinds
    for semantics in ("eager", "rendezvous"):
        validate(plan, semantics=semantics)


def test_owner_backward_sends_feature_gradients_after_the_first_stage_is_done():
    plan = compose(vlm(order="prefix", backward="owner"), MICROBATCHES)
    first = plan.programs[0]
    last_compute = max(i for i, a in enumerate(first) if a.kind in COMPUTE)
    grads = [a for a in first[last_compute:] if a.kind is Kind.SEND_GRAD]
    others = sorted(set(range(MICROBATCHES)) - set(owned(0)))
    assert [a.microbatch for a in grads] == others
    for rank in range(1, STAGES):  # owners run their backwards after their pipeline work
        order = computes(plan, rank)
        assert order[-len(owned(rank)):] == [("B", "vit", m) for m in owned(rank)]
        assert plan.programs[rank][-1].kind is Kind.GRAD_REDUCE
    validate(plan)


def test_recompute_costs_one_forward_more_and_holds_nothing_on_the_owners():
    costs = CostTable({"vit": RegionCost(forward=1.0, stored_bytes=1.0, input_bytes=1e6),
                       "llm": RegionCost(forward=4.0, stored_bytes=1.0)})
    owner = simulate(compose(vlm(), MICROBATCHES), costs)
    recompute = simulate(compose(vlm(backward="recompute"), MICROBATCHES), costs)
    spans = {iv.action.microbatch: iv.end - iv.start for iv in recompute.intervals
             if iv.action.kind is Kind.BACKWARD and iv.action.region == "vit"}
    assert spans == pytest.approx({m: 2.0 if m in owned(0) else 3.0 for m in range(MICROBATCHES)})
    for rank in range(1, STAGES):
        assert recompute.peak_live[rank] < owner.peak_live[rank]  # only LLM stages held
    assert recompute.busy[0] > owner.busy[0]  # the first stage does every ViT backward


@pytest.mark.parametrize("order, backward, backbone, trainable, semantics", list(itertools.product(
    ["ready", "prefix"], ["owner", "recompute"], ["1f1b", "gpipe", "interleaved", "zb-h1"],
    [True, False], ["eager", "rendezvous"])))
def test_every_option_composes_and_validates(order, backward, backbone, trainable, semantics):
    llm = {"1f1b": OneFOneB(stages=STAGES), "gpipe": GPipe(stages=STAGES),
           "interleaved": Interleaved1F1B(stages=STAGES), "zb-h1": ZeroBubbleH1(stages=STAGES)}[backbone]
    plan = compose(vlm(trainable, llm, order=order, backward=backward), MICROBATCHES, semantics=semantics)
    validate(plan)
    simulate(plan, CostTable({"vit": RegionCost(forward=1.0), "llm": RegionCost(forward=4.0)}))


def test_validate_holds_recompute_plans_to_their_placement():
    plan = compose(vlm(backward="recompute"), MICROBATCHES)
    reduce = dataclasses.replace(plan.programs[0][0], kind=Kind.GRAD_REDUCE)
    programs = {rank: p + (reduce,) for rank, p in plan.programs.items()}
    with pytest.raises(ScheduleError, match="runs every backward on one rank .*: no gradient reduce"):
        validate(dataclasses.replace(plan, programs=programs))
    stray = next(a for a in plan.programs[0] if a.kind is Kind.BACKWARD and a.region == "vit" and a.microbatch == 1)
    moved = {**plan.programs, 0: tuple(a for a in plan.programs[0] if a != stray),
             1: plan.programs[1] + (stray,)}
    with pytest.raises(ScheduleError, match=r"vit.s0 mb1 is placed on rank 0, not 1"):
        validate(dataclasses.replace(plan, programs=moved))


def test_options_refuse_what_they_cannot_do():
    with pytest.raises(ScheduleError, match=r"order must be one of \('ready', 'prefix', 'phased'\)"):
        Transpose(order="zigzag")
    with pytest.raises(ScheduleError, match="backward must be 'owner' or 'recompute'"):
        Transpose(backward="stage0")
    with pytest.raises(ScheduleError, match="owners keep none"):
        Transpose(backward="recompute", max_in_flight=2)
    with pytest.raises(ScheduleError, match="max_in_flight cannot bound it"):
        Transpose(order="prefix", max_in_flight=2)
    head = [Region("llm", 4, OneFOneB(stages=2)), Region("head", 1, Transpose(order="prefix"))]
    with pytest.raises(ScheduleError, match="'head': order='prefix' needs the sharded pipeline it runs on right after it"):
        compose(head, 4)
    second = [Region("vit", 2, Transpose(backward="recompute")), Region("llm", 4, OneFOneB(stages=2)),
              Region("vit2", 1, Transpose(backward="recompute"))]
    with pytest.raises(ScheduleError, match="'vit2'"):
        compose(second, 4)
