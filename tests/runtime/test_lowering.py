"""The plan's lowering (:mod:`mindspeed_flow.runtime.lowering`): every action as the
primitive operations the executor runs, every message with its typed channel and tag; the
send-bound and FIFO analyses read the same list; what the runtime cannot run is refused
before the first step.  No processes."""

from __future__ import annotations

from collections import Counter

import pytest

from mindspeed_flow.runtime import Executor
from mindspeed_flow.runtime.fifo import channel_groups, fifo_mismatches
from mindspeed_flow.runtime.layout import megatron_layout
from mindspeed_flow.runtime.lowering import MESSAGES, OpKind, Payload, lower
from mindspeed_flow.runtime.sends import deadlock_with_bound, plan_send_bound
from mindspeed_flow.schedule import Decoupled, OneFOneB, Region, ScheduleError, Transpose, compose
from mindspeed_flow.schedule.keys import BoundaryKey, BoundaryKind, CollectiveKey


def _transposed(microbatches: int = 2, frozen: bool = False):
    return compose([Region("vit", 1, Transpose(), trainable=not frozen), Region("llm", 2, OneFOneB(stages=2))],
                   microbatches)


def test_the_lowered_program_prints_one_operation_per_line():
    text = lower(_transposed()).format().splitlines()
    assert text[:5] == [
        "r0 #0   pack    params of vit",
        "r0 #0   send    [BCAST:vit] params r0->r1 tag=2",
        "r0 #1   compute F vit.s0 mb0",
        "r0 #2   compute F llm.s0 mb0",
        "r0 #3   send    [llm.s0:act] mb0 r0->r1 tag=6",
    ]
    assert "r1 #0   recv    [BCAST:vit] params r0->r1 tag=2" in text


def test_collectives_lower_to_the_messages_the_executor_posts():
    """BCAST: the root packs and sends to each member; REDUCE: every replica packs, the root
    receives each member's gradients then sends the sum back, every replica unpacks."""
    lowered = lower(_transposed())
    for rank, ops in lowered.programs.items():
        reduce = [op for op in ops if op.action.kind.value == "REDUCE"]
        kinds = [(op.kind, op.payload or op.message.payload) for op in reduce]
        root = rank == reduce[0].action.group[0]
        middle = [(OpKind.RECV, Payload.GRADS), (OpKind.SEND, Payload.SUM)] if root else \
            [(OpKind.SEND, Payload.GRADS), (OpKind.RECV, Payload.SUM)]
        assert kinds == [(OpKind.PACK, Payload.GRADS), *middle, (OpKind.UNPACK, Payload.SUM)]
        assert all(isinstance(op.message.channel, CollectiveKey) for op in reduce if op.message)
        bcast = [op.kind for op in ops if op.action.kind.value == "BCAST"]
        assert bcast == ([OpKind.PACK, OpKind.SEND] if root else [OpKind.RECV, OpKind.UNPACK])


@pytest.mark.parametrize("plan", [compose(megatron_layout(4, 2), 8), _transposed(4)], ids=["interleaved", "transpose"])
def test_every_message_has_one_sender_and_one_receiver_under_one_tag(plan):
    ends = Counter((op.kind, op.message) for _, op in lower(plan).messages())
    messages = {m for _, m in ends}
    assert all(ends[(OpKind.SEND, m)] == ends[(OpKind.RECV, m)] == 1 for m in messages)
    tags = {}
    for m in messages:
        assert tags.setdefault((m.channel, m.microbatch), m.tag) == m.tag
        assert isinstance(m.channel, (BoundaryKey, CollectiveKey))
    assert len(set(tags.values())) == len(tags)


def test_boundary_messages_carry_their_keys_kind():
    for _, op in lower(_transposed(4)).messages():
        if op.message.microbatch is not None:
            assert op.message.payload.value == op.message.channel.kind.value
            assert op.message.channel == op.action.key


def test_forward_only_drops_backwards_gradients_and_reduces():
    plan = _transposed(4)
    ops = [op for program in lower(plan, forward_only=True).programs.values() for op in program]
    assert {op.action.kind.value for op in ops} == {"BCAST", "F", "SEND_A", "RECV_A"}
    assert all(op.message.channel.kind is BoundaryKind.ACT for op in ops if op.message and op.message.microbatch is not None)


def test_sends_and_fifo_read_the_lowered_list():
    plan = _transposed(4)
    lowered = lower(plan)
    assert plan_send_bound(lowered) == plan_send_bound(plan)
    assert deadlock_with_bound(lowered, 1) == deadlock_with_bound(plan, 1)
    assert channel_groups(lowered) == channel_groups(plan)
    assert [str(m) for m in fifo_mismatches(lowered)] == [str(m) for m in fifo_mismatches(plan)]
    assert sum(1 for _ in lowered.messages()) == sum(1 for p in lowered.programs.values() for op in p
                                                     if op.kind in MESSAGES)


def test_the_executor_runs_the_lowering_it_prepared():
    plan = _transposed(4)
    executor = Executor(0, [0, 1], store=None)
    prepared = executor.prepare(plan)
    assert prepared is executor.lowered(plan) and prepared.programs == lower(plan).programs
    assert executor.lowered(plan, forward_only=True).forward_only


def test_a_pool_plan_without_a_pool_is_refused_before_the_first_step():
    plan = compose([Region("vit", 1, Decoupled(ranks=1)), Region("llm", 2, OneFOneB(stages=2))], 4)
    with pytest.raises(ScheduleError, match=r"r0 #\d+ PUT .*through the pool, but this executor has none"):
        Executor(0, [0, 1, 2], store=None).prepare(plan)
    Executor(0, [0, 1, 2], store=None, pool=object()).prepare(plan)  # validated, never run
    Executor(2, [0, 1, 2], store=None).prepare(plan)  # the backbone's last stage has no pool transfer


def test_a_recomputed_backward_is_refused_naming_the_action():
    plan = compose([Region("vit", 1, Transpose(backward="recompute")), Region("llm", 2, OneFOneB(stages=2))], 4)
    with pytest.raises(ScheduleError, match=r"r0 #\d+ RECV_A .*\[vit\.s0:input\]: Transpose\(backward='recompute'\)"):
        Executor(0, [0, 1], store=None).prepare(plan)
