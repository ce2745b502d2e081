"""The runtime's send-buffer bound, derived from the plan (no processes: the executor's
replay in :mod:`mindspeed_flow.runtime.sends`).  The processes' side (a windowed plan runs
exactly, its peak within the bound) is in test_executor.py."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from mindspeed_flow.runtime import Executor, RuntimeOptions
from mindspeed_flow.runtime.lowering import BLOCKING, OpKind, lower
from mindspeed_flow.runtime.sends import deadlock_with_bound, plan_send_bound
from mindspeed_flow.schedule import OneFOneB, Region, ScheduleError, Transpose, compose, validate


def _vlm(window: int | None, ranks: int = 4, microbatches: int = 8, semantics: str = "eager"):
    regions = [Region("vit", 1, Transpose(max_in_flight=window)), Region("llm", ranks, OneFOneB(stages=ranks))]
    return compose(regions, microbatches, semantics=semantics)


def _random_peak(plan, rng: random.Random) -> int:
    """The largest span of live sends one random interleaving of the unbounded replay
    reaches (a rank's send stays live until its receive is posted, in posting order)."""
    programs = lower(plan).programs
    pc = {r: 0 for r in programs}
    live = {r: [] for r in programs}
    posted, received, peak = set(), set(), 0
    while True:
        ready = [r for r, ops in programs.items() if pc[r] < len(ops)
                 and not (ops[pc[r]].kind in BLOCKING and ops[pc[r]].message not in posted)]
        if not ready:
            break
        r = rng.choice(ready)
        op = programs[r][pc[r]]
        if op.kind in BLOCKING:
            received.add(op.message)
        elif op.message is not None:
            posted.add(op.message)
        if op.kind is OpKind.SEND:
            live[r].append(op.message)
            peak = max(peak, len(live[r]))
        pc[r] += 1
        for s in programs:
            while live[s] and live[s][0] in received:
                live[s].pop(0)
    assert all(pc[r] == len(ops) for r, ops in programs.items())
    return peak


@pytest.mark.parametrize("window", [None, 1])
def test_no_interleaving_holds_more_sends_than_the_plans_bound(window):
    plan = _vlm(window)
    bound = plan_send_bound(plan)
    rng = random.Random(0)
    peaks = [_random_peak(plan, rng) for _ in range(200)]
    assert max(peaks) <= bound
    assert max(peaks) >= bound - 1  # the adversarial interleaving is (nearly) reached by chance


def test_the_in_flight_window_lowers_the_bound():
    """A trainable encoder's owner starts microbatch k+w only after k's backward, which needs
    its gradient back: the window caps what the plan keeps in flight, and so the bound."""
    unbounded, windowed = plan_send_bound(_vlm(None)), plan_send_bound(_vlm(1))
    assert windowed < unbounded
    assert windowed <= 4 < unbounded  # 8 microbatches over 4 owners, one in flight each


def test_a_bound_too_small_for_an_eager_plan_is_refused_naming_where():
    """`<transpose, 1f1b>` composed for eager needs several live sends: a bound that would
    stop it is refused before the first step, with the stuck ranks and the plan's bound."""
    plan = _vlm(None)
    validate(plan, semantics="eager")
    bound = plan_send_bound(plan)
    needed = next(k for k in range(1, bound + 1) if deadlock_with_bound(plan, k) is None)
    assert 1 < needed <= bound
    stuck = deadlock_with_bound(plan, needed - 1)
    assert stuck is not None and "waits for" in stuck and stuck.startswith("r")
    with pytest.raises(ScheduleError, match=rf"max_pending_sends={needed - 1} can deadlock .* own bound is {bound}"):
        Executor(0, [0, 1, 2, 3], store=None, options=RuntimeOptions(max_pending_sends=needed - 1)).send_bound(plan)
    executor = Executor(0, [0, 1, 2, 3], store=None, options=RuntimeOptions(max_pending_sends=needed))
    assert executor.send_bound(plan) == needed
    assert Executor(0, [0, 1, 2, 3], store=None).send_bound(plan) == bound
    rendezvous = _vlm(None, semantics="rendezvous")
    assert deadlock_with_bound(rendezvous, 1) is None  # gloo sends complete at the receive


def test_a_batch_the_executor_cannot_run_in_program_order_is_refused():
    """The validator posts a batch of transfers at once; the executor runs them in order.
    Receives put before the sends of their batch pass validation but would hang here."""
    plan = compose([Region("llm", 2, OneFOneB(stages=2))], 4)
    programs = {}
    for rank, program in plan.programs.items():
        program = list(program)
        for i in range(len(program) - 1):
            pair = {program[i].kind.value, program[i + 1].kind.value}
            if pair in ({"SEND_A", "RECV_G"}, {"SEND_G", "RECV_A"}) and program[i].kind.value.startswith("SEND"):
                program[i], program[i + 1] = program[i + 1], program[i]
        programs[rank] = tuple(program)
    swapped = replace(plan, programs=programs)
    validate(swapped, semantics="eager")
    with pytest.raises(ScheduleError, match=r"cannot run this plan: r0 #\d+ RECV_G .* waits for the matching send"):
        plan_send_bound(swapped)
    with pytest.raises(ScheduleError, match="cannot run this plan"):
        Executor(0, [0, 1], store=None).prepare(swapped)
