"""The runtime on plain PyTorch models over gloo: `<transpose, 1f1b>` with a frozen and a
trainable encoder equals a single process; eager plans that would deadlock under rendezvous
run (the runtime's contract), and rendezvous plans run too; invalid plans never run;
failures surface on every rank naming the rank, action index and action; the measured
timeline draws with the simulator's Gantt code."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import torch

from megatron_cpu_harness import HarnessError, launch
from mindspeed_flow.runtime import ActionFailed, Binding, Executor, RuntimeOptions, WaitPolicy, measured_result
from mindspeed_flow.runtime.errors import where
from mindspeed_flow.runtime.sends import plan_send_bound
from mindspeed_flow.schedule import OneFOneB, Region, ScheduleError, Transpose, compose, validate
from mindspeed_flow.schedule.gantt import draw
from tiny_vlm import build, forward_step, grads_of, make_batches, reference

MICROBATCHES = 4


def _regions(frozen: bool, window: int | None = None) -> list[Region]:
    return [Region("vit", 1, Transpose(max_in_flight=window), trainable=not frozen),
            Region("llm", 2, OneFOneB(stages=2))]


def _bindings(rank: int, parts: dict, batches: list) -> dict:
    data = iter(batches)  # one iterator per rank, shared by its chunks, as Megatron's is
    return {("vit", 0): Binding(parts["vit"], data), ("llm", rank): Binding(parts[f"llm{rank}"], data)}


def _transpose_worker(rank: int, world_size: int) -> dict:
    """Frozen and trainable encoder -> :func:`_transpose_runs`, in one launch."""
    return {frozen: _transpose_runs(rank, frozen) for frozen in (True, False)}


def _transpose_runs(rank: int, frozen: bool) -> dict:
    """Both plans (eager, rendezvous) of `<transpose, 1f1b>`, and the eager one with an
    in-flight window of 1; rank 1's encoder starts from other weights, so only the broadcast
    can make it equal the reference."""
    out = {}
    for semantics, bound in (("eager", None), ("eager-window", None), ("rendezvous", None),
                             ("rendezvous-bounded", 1)):
        parts = build(frozen_encoder=frozen)
        if rank == 1 and not frozen:
            with torch.no_grad():
                for p in parts["vit"].parameters():
                    p.add_(1.0)
        window = 1 if semantics == "eager-window" else None
        plan = compose(_regions(frozen, window), MICROBATCHES, semantics=semantics.split("-")[0])
        executor = Executor(rank, [0, 1], options=RuntimeOptions(max_pending_sends=bound))
        result = executor.run(plan, forward_step, _bindings(rank, parts, make_batches(MICROBATCHES)))
        mine = {"vit": parts["vit"], f"llm{rank}": parts[f"llm{rank}"]}
        out[semantics] = {"losses": [float(d["loss"]) for d in result.forward_data_store],
                          "grads": grads_of(mine), "timeline": result.timeline,
                          "peak_pending": result.peak_pending_sends,
                          "bound": executor.send_bound(plan)}
    return out


@pytest.fixture(scope="module")
def transpose_runs():
    return launch(_transpose_worker, 2, timeout_s=180)


@pytest.fixture(scope="module", params=[True, False], ids=["frozen-vit", "trainable-vit"])
def transposed(request, transpose_runs):
    frozen = request.param
    expected = reference(build(frozen_encoder=frozen), make_batches(MICROBATCHES))
    return frozen, expected, [r[frozen] for r in transpose_runs]


def test_eager_only_plan_is_the_contract():
    """The `<transpose, 1f1b>` plan the runtime runs deadlocks under rendezvous semantics:
    that it runs at all (below) shows the runtime's sends are eager."""
    for frozen in (True, False):
        plan = compose(_regions(frozen), MICROBATCHES, semantics="eager")
        validate(plan)
        with pytest.raises(ScheduleError, match="deadlock under rendezvous"):
            validate(plan, semantics="rendezvous")


@pytest.mark.parametrize("semantics", ["eager", "eager-window", "rendezvous", "rendezvous-bounded"])
def test_transpose_1f1b_equals_single_process(transposed, semantics):
    frozen, (ref_losses, ref_grads), ranks = transposed
    first, last = (r[semantics] for r in ranks)
    assert first["losses"] == [] and last["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=0)
    assert ("vit.patch_embed.weight" in ref_grads) is not frozen
    for rank, found in enumerate((first, last)):
        for name, expected in ref_grads.items():
            if name.startswith(("vit.", f"llm{rank}.")):
                torch.testing.assert_close(found["grads"][name], expected, rtol=1e-6, atol=1e-7, msg=name)
        assert set(found["grads"]) == {n for n in ref_grads if n.startswith(("vit.", f"llm{rank}."))}


def test_send_buffers_stay_within_the_plans_bound(transposed):
    """By default a step never holds more send buffers than the plan's own bound, which the
    in-flight window lowers for a trainable encoder; asked for one, a rendezvous plan runs
    with one buffer alive at a time, while the eager plan keeps several (its encoder
    replicas run ahead).  Exactness of all of these: the test above."""
    frozen, _, ranks = transposed
    for semantics in ("eager", "eager-window", "rendezvous"):
        for r in ranks:
            assert 1 <= r[semantics]["peak_pending"] <= r[semantics]["bound"], semantics
    assert ranks[0]["eager"]["bound"] == plan_send_bound(compose(_regions(frozen), MICROBATCHES))
    assert (ranks[0]["eager-window"]["bound"] < ranks[0]["eager"]["bound"]) is not frozen
    assert all(r["rendezvous-bounded"]["peak_pending"] == 1 for r in ranks)
    assert max(r["eager"]["peak_pending"] for r in ranks) > 1


def test_measured_timeline_draws_with_the_simulators_gantt(transposed, tmp_path):
    frozen, _, ranks = transposed
    plan = compose(_regions(frozen), MICROBATCHES)
    measured = measured_result(plan, [r["eager"]["timeline"] for r in ranks])
    computes = [iv for iv in measured.intervals if iv.action.kind.value in "FBI"]
    assert len(computes) == sum(1 for p in plan.programs.values() for a in p if a.kind.value in ("F", "B", "I"))
    assert all(0 <= iv.start <= iv.end <= measured.step_time for iv in measured.intervals)
    assert 0.0 < measured.bubble_fraction < 1.0
    png = draw(measured, tmp_path / "measured.png", title="measured")
    assert png.stat().st_size > 5000


def test_invalid_plan_is_refused_before_the_first_step():
    plan = compose(_regions(False), MICROBATCHES)
    program = list(plan.programs[1])
    dropped = next(i for i, a in enumerate(program) if a.kind.value == "RECV_A")
    broken = replace(plan, programs={**plan.programs, 1: tuple(program[:dropped] + program[dropped + 1:])})
    executor = Executor(0, [0, 1], store=None)
    with pytest.raises(ScheduleError):
        executor.run(broken, forward_step, {})  # validated before anything runs or is bound


def test_runtime_refuses_a_group_of_the_wrong_size():
    with pytest.raises(ScheduleError, match="the plan has 2 ranks but the runtime's group has 3"):
        Executor(0, [0, 1, 2], store=None).prepare(compose(_regions(False), MICROBATCHES))


# --------------------------------------------------------------------------- faults

FAILING = ("B", "llm", 1, 3)  # the backward of llm.s1 for microbatch 3, on rank 1


def _failing_action():
    plan = compose(_regions(False), MICROBATCHES)
    index, action = next((i, a) for i, a in enumerate(plan.programs[1])
                         if (a.kind.value, a.region, a.stage, a.microbatch) == FAILING)
    return plan, where(1, index, action)


def _fault_worker(rank: int, world_size: int, mode: str) -> dict:
    plan, _ = _failing_action()
    parts = build()

    def faulty_step(data_iterator, model):
        output, loss = forward_step(data_iterator, model)
        m = data_iterator.microbatch
        if rank == 1 and model is parts["llm1"] and m == FAILING[3]:
            if mode == "die":
                os._exit(3)  # noqa: SLF001 - a rank dying without a word
            if mode == "hang":
                time.sleep(4.0)  # alive, but past the others' 1.5 s timeout
                return output, loss
            output.register_hook(lambda grad: (_ for _ in ()).throw(ValueError("deliberate backward failure")))
        return output, loss

    # A raised or dying rank surfaces through the abort, not the timeout: 20 s leaves a loaded
    # machine (CI's two lanes on 2 cores) no false "no progress" before it.
    options = RuntimeOptions(wait=WaitPolicy(timeout_s=1.5 if mode == "hang" else 20.0, abort_poll_s=0.05))
    executor = Executor(rank, [0, 1], options=options)
    # a first step imports what autograd loads lazily (seconds): not part of the fault
    Executor(rank, [0, 1]).run(plan, forward_step, _bindings(rank, build(), make_batches(MICROBATCHES)))
    torch.distributed.barrier()  # ranks start their step together: waits measure the step only
    start = time.monotonic()
    try:
        executor.run(plan, faulty_step, _bindings(rank, parts, make_batches(MICROBATCHES)))
    except ActionFailed as exc:
        if mode == "die":
            raise
        return {"error": str(exc), "seconds": time.monotonic() - start}
    return {"error": None}


def test_an_exception_in_one_ranks_backward_surfaces_on_every_rank():
    _, failing = _failing_action()
    assert failing.startswith("r1 #") and failing.endswith(" B llm.s1 mb3")
    reports = launch(_fault_worker, 2, "raise", timeout_s=120)
    assert reports[1]["error"].startswith(f"{failing}: ValueError: deliberate backward failure")
    assert reports[0]["error"].startswith("r0 #") and failing in reports[0]["error"]
    assert all(r["seconds"] < 10 for r in reports)


def test_a_hanging_rank_is_reported_after_the_timeout_and_learns_why():
    waiting, hanging = launch(_fault_worker, 2, "hang", timeout_s=120)
    assert waiting["error"].startswith("r0 #") and "no progress for 1.5 s waiting for `RECV_" in waiting["error"]
    assert 1.5 <= waiting["seconds"] < 10
    # the slow rank goes on, and stops at its next wait with rank 0's report
    where_r0 = waiting["error"].split(":")[0]
    assert hanging["error"].startswith("r1 #") and where_r0 in hanging["error"]


def test_a_dying_rank_surfaces_on_the_others_within_the_timeout():
    started = time.monotonic()
    with pytest.raises(HarnessError) as failure:
        launch(_fault_worker, 2, "die", timeout_s=60)
    text = str(failure.value)
    assert "rank 1 failed first; every rank was stopped:\ndied with exit code 3" in text
    assert "ActionFailed: r0 #" in text  # rank 0 names its own action and the peer's loss
    assert time.monotonic() - started < 50
