"""Per-pair posting order, the condition for a plan to run on a backend that ignores tags
(NCCL, HCCL): :mod:`mindspeed_flow.runtime.fifo`, checked without processes or devices."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_runtime import MICROBATCHES, _regions

from mindspeed_flow.runtime.fifo import check_posting_order, fifo_mismatches, needs_fifo_order
from mindspeed_flow.runtime.layout import megatron_layout
from mindspeed_flow.runtime.sends import plan_send_bound
from mindspeed_flow.schedule import ScheduleError, compose, validate


@pytest.mark.parametrize("stages,chunks", [(2, 1), (4, 1), (2, 2), (4, 2)])
@pytest.mark.parametrize("microbatches", [4, 8])
def test_megatrons_own_layouts_agree_per_pair(stages, chunks, microbatches):
    """1F1B and interleaved 1F1B post, on each link, activations in microbatch order on both
    ends (and gradients likewise): the sender's and receiver's orders are the same sequence,
    so Megatron's layout runs on NCCL / HCCL as it does on gloo."""
    plan = compose(megatron_layout(stages, chunks), microbatches)
    assert fifo_mismatches(plan) == []
    check_posting_order(plan, "nccl")


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("window", [None, 1])
def test_eager_transpose_1f1b_plans_disagree_rendezvous_ones_agree(frozen, window):
    """The `<transpose, 1f1b>` plans of test_runtime.py.  Composed for eager semantics, a
    transposed encoder's owner sends its activations ahead (sends never wait) while the
    receiver first takes a gradient or an earlier activation on the same link: the orders
    differ, so these plans cannot run on NCCL yet.  Composed for rendezvous semantics every
    send waits for its receive, which forces one common order per link: they agree."""
    eager = compose(_regions(frozen, window), MICROBATCHES, semantics="eager")
    found = fifo_mismatches(eager)
    assert found, "an eager transposed plan agreeing per pair would change docs/runtime.md"
    assert all("[vit.s0:" in f"{m.send} {m.recv}" for m in found)  # the transposed encoder's transfers
    with pytest.raises(ScheduleError, match=r"cannot run on nccl yet; it can run on gloo"):
        check_posting_order(eager, "nccl")
    check_posting_order(eager, "gloo")
    assert fifo_mismatches(compose(_regions(frozen, window), MICROBATCHES, semantics="rendezvous")) == []


def _interleaved_with_two_sends_swapped():
    """Megatron's interleaved 1F1B (2 ranks, 2 chunks) with rank 0's send of model.s2 mb1
    moved after its next compute and send (model.s0 mb2): each channel keeps its order, so
    validate (which pairs per channel) accepts it and the executor's replay runs it, but
    r0 -> r1 now carries s0 mb2 where r1 first receives s2 mb1."""
    plan = compose(megatron_layout(2, 2), 4)
    program = list(plan.programs[0])
    assert [str(a).split()[:3] for a in program[9:12]] == [["SEND_A", "model.s2", "mb1"], ["F", "model.s0", "mb2"],
                                                           ["SEND_A", "model.s0", "mb2"]]
    program[9:12] = program[10:12] + program[9:10]
    return replace(plan, programs={**plan.programs, 0: tuple(program)})


def test_a_reordered_plan_validate_accepts_is_refused_naming_the_pair():
    plan = _interleaved_with_two_sends_swapped()
    validate(plan, semantics="eager")
    plan_send_bound(plan)  # the executor's own replay runs it too
    (mismatch,) = fifo_mismatches(plan)
    assert (mismatch.src, mismatch.dst, mismatch.n) == (0, 1, 3)
    pattern = (r"r0 -> r1: message 4: r0 posts r0 #10 SEND_A model\.s0 mb2 .*, "
               r"r1 posts r1 #10 RECV_A model\.s3 mb1 .*it can run on gloo")
    for backend in ("nccl", "hccl", "NCCL"):
        with pytest.raises(ScheduleError, match=pattern):
            check_posting_order(plan, backend)
    check_posting_order(plan, "gloo")  # gloo matches by tag: nothing to check


def test_only_gloo_matches_by_tag():
    assert not needs_fifo_order("gloo")
    assert needs_fifo_order("nccl") and needs_fifo_order("hccl") and needs_fifo_order("mpi")
