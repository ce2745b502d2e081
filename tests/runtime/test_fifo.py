"""Per-pair posting order, the condition for a plan to run on a backend that ignores tags
(NCCL, HCCL): :mod:`mindspeed_flow.runtime.fifo`, checked without processes or devices."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tests.runtime.test_executor import MICROBATCHES, _bindings, _regions

from megatron_cpu_harness import launch
from mindspeed_flow.runtime import Executor, RuntimeOptions, WaitPolicy
from mindspeed_flow.runtime.fifo import channel_groups, check_posting_order, fifo_mismatches, needs_fifo_order
from mindspeed_flow.runtime.layout import megatron_layout
from mindspeed_flow.runtime.sends import plan_send_bound
from mindspeed_flow.schedule import ScheduleError, compose, validate
from tiny_vlm import build, forward_step, grads_of, make_batches, reference


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
def test_eager_transpose_1f1b_plans_disagree_per_pair_agree_per_channel(frozen, window):
    """The `<transpose, 1f1b>` plans of test_executor.py.  Composed for eager semantics, a
    transposed encoder's owner sends its activations ahead (sends never wait) while the
    receiver first takes a gradient or an earlier activation on the same link: the orders
    differ in one communicator per pair.  With a communicator per channel (the runtime's
    default on NCCL / HCCL) each channel's order is the validator's per-key FIFO: they
    agree.  Composed for rendezvous semantics every send waits for its receive, which
    forces one common order per link: they agree even in one communicator."""
    eager = compose(_regions(frozen, window), MICROBATCHES, semantics="eager")
    found = fifo_mismatches(eager)
    assert found, "an eager transposed plan agreeing per pair would change docs/runtime.md"
    assert all("[vit.s0:" in f"{m.send} {m.recv}" for m in found)  # the transposed encoder's transfers
    with pytest.raises(ScheduleError, match=r"in one communicator per pair: .*it can run on gloo"):
        check_posting_order(eager, "nccl")
    assert fifo_mismatches(eager, per_channel=True) == []
    check_posting_order(eager, "nccl", per_channel=True)
    check_posting_order(eager, "gloo")
    assert fifo_mismatches(compose(_regions(frozen, window), MICROBATCHES, semantics="rendezvous")) == []


def test_channel_groups_are_the_plans_keys_sorted_with_their_ranks():
    """The communicators every rank creates, in this order: one per transfer key (a
    boundary's activations, its gradients, a region's broadcast and reduce), among the ranks
    that use it; a frozen encoder has no gradient, broadcast or reduce channel."""
    trainable = compose(_regions(False), MICROBATCHES, semantics="eager")
    assert channel_groups(trainable) == [("BCAST:vit", (0, 1)), ("REDUCE:vit", (0, 1)), ("llm.s0:act", (0, 1)),
                                         ("llm.s0:grad", (0, 1)), ("vit.s0:act", (0, 1)), ("vit.s0:grad", (0, 1))]
    frozen = compose(_regions(True), MICROBATCHES, semantics="eager")
    assert [c for c, _ in channel_groups(frozen)] == ["llm.s0:act", "llm.s0:grad", "vit.s0:act"]
    four = compose(megatron_layout(4, 1), 4)
    assert channel_groups(four)[:2] == [("model.s0:act", (0, 1)), ("model.s0:grad", (0, 1))]
    assert channel_groups(four)[-1] == ("model.s2:grad", (2, 3))


def _swapped_within_one_channel():
    """Megatron's 1F1B (2 ranks): rank 1's receives of model.s0's activations for mb0 and
    mb1 swapped - the same channel, so even one communicator per channel mismatches (the
    validator's per-key FIFO pairing refuses it too; this checks fifo's own condition)."""
    plan = compose(megatron_layout(2, 1), 4)
    program = list(plan.programs[1])
    recvs = [i for i, a in enumerate(program) if str(a).startswith("RECV_A") and "[model.s0:act]" in str(a)]
    first, second = recvs[:2]
    program[first], program[second] = program[second], program[first]
    return replace(plan, programs={**plan.programs, 1: tuple(program)})


def test_a_reorder_within_a_channel_is_refused_per_channel_too():
    plan = _swapped_within_one_channel()
    with pytest.raises(ScheduleError):
        validate(plan, semantics="eager")
    (mismatch,) = fifo_mismatches(plan, per_channel=True)
    assert (mismatch.src, mismatch.dst, mismatch.n, mismatch.channel) == (0, 1, 0, "model.s0:act")
    with pytest.raises(ScheduleError, match=r"r0 -> r1 on channel model\.s0:act: message 1: .*mb0.*mb1"):
        check_posting_order(plan, "hccl", per_channel=True)


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
    # the swap crosses channels (s2 vs s0 activations): a communicator per channel runs it
    assert fifo_mismatches(plan, per_channel=True) == []


def test_only_gloo_matches_by_tag():
    assert not needs_fifo_order("gloo")
    assert needs_fifo_order("nccl") and needs_fifo_order("hccl") and needs_fifo_order("mpi")


def _channel_groups_worker(rank: int, world_size: int) -> dict:
    """The trainable eager `<transpose, 1f1b>` plan over gloo with a process group per
    channel forced on: a transfer posted on another group than its receive would never
    match, and the step would time out."""
    parts = build(frozen_encoder=False)
    if rank == 1:
        with torch.no_grad():
            for p in parts["vit"].parameters():
                p.add_(1.0)  # only the broadcast (on its own channel) can undo this
    plan = compose(_regions(False), MICROBATCHES, semantics="eager")
    options = RuntimeOptions(wait=WaitPolicy(timeout_s=20.0), channel_groups=True)
    executor = Executor(rank, [0, 1], options=options)
    result = executor.run(plan, forward_step, _bindings(rank, parts, make_batches(MICROBATCHES)))
    return {"losses": [float(d["loss"]) for d in result.forward_data_store],
            "grads": grads_of({"vit": parts["vit"], f"llm{rank}": parts[f"llm{rank}"]}),
            "channels": sorted(executor.channels)}


def test_channel_groups_route_every_transfer_over_gloo():
    ref_losses, ref_grads = reference(build(frozen_encoder=False), make_batches(MICROBATCHES))
    first, last = launch(_channel_groups_worker, 2, timeout_s=120)
    expected = [c for c, _ in channel_groups(compose(_regions(False), MICROBATCHES, semantics="eager"))]
    assert first["channels"] == last["channels"] == expected
    assert last["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=0)
    for rank, found in enumerate((first, last)):
        for name, value in ref_grads.items():
            if name.startswith(("vit.", f"llm{rank}.")):
                torch.testing.assert_close(found["grads"][name], value, rtol=1e-6, atol=1e-7, msg=name)
