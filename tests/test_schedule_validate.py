"""The validator on programs broken on purpose: each fault is caught and named."""

from __future__ import annotations

import dataclasses

import pytest

from mindspeed_flow.schedule import (
    Decoupled,
    Kind,
    OneFOneB,
    Region,
    ScheduleError,
    Transpose,
    compose,
    validate,
)


def one_f_one_b(stages=2, microbatches=4):
    return compose([Region("llm", 4, OneFOneB(stages=stages))], microbatches)


def edited(plan, rank, edit):
    """The plan with ``edit(list_of_actions)`` applied to one rank's program."""
    program = list(plan.programs[rank])
    edit(program)
    return dataclasses.replace(plan, programs={**plan.programs, rank: tuple(program)})


def index_of(plan, rank, text):
    return next(i for i, a in enumerate(plan.programs[rank]) if str(a).startswith(text))


def dropped(plan, rank, text):
    """The plan without the action of one rank's program named by its text."""
    i = index_of(plan, rank, text)
    return edited(plan, rank, lambda program: program.pop(i))


def swapped(plan, rank, first, second):
    """The plan with two actions of one rank's program (named by their text) exchanged."""
    i, j = index_of(plan, rank, first), index_of(plan, rank, second)

    def swap(program):
        program[i], program[j] = program[j], program[i]

    return edited(plan, rank, swap)


def test_composed_plans_pass():
    validate(one_f_one_b())
    validate(one_f_one_b(), semantics="rendezvous")


def test_a_send_without_its_receive():
    broken = dropped(one_f_one_b(), 1, "RECV_A llm.s1 mb3")
    with pytest.raises(ScheduleError, match=r"rank 0 action #\d+ `SEND_A llm.s0 mb3 -> r1 .*` has no matching receive on rank 1"):
        validate(broken)


def test_a_receive_without_its_send():
    broken = dropped(one_f_one_b(), 1, "SEND_G llm.s1 mb3")
    with pytest.raises(ScheduleError, match=r"rank 0 action #\d+ `RECV_G llm.s0 mb3 <- r1 .*` has no matching send on rank 1"):
        validate(broken)


def test_messages_out_of_order_on_a_channel():
    plan = one_f_one_b()
    a, b = index_of(plan, 1, "RECV_A llm.s1 mb1"), index_of(plan, 1, "RECV_A llm.s1 mb2")

    def swap(p):
        p[a], p[b] = dataclasses.replace(p[a], microbatch=2), dataclasses.replace(p[b], microbatch=1)

    with pytest.raises(ScheduleError, match=r"channel r0->r1 \[llm.s0:act\]: shape key mismatch, .* sends mb1 but .* receives mb2"):
        validate(edited(plan, 1, swap))


def test_a_receive_expecting_another_shape_key():
    plan = one_f_one_b()
    i = index_of(plan, 1, "RECV_A llm.s1 mb2")

    def rekey(p):
        p[i] = dataclasses.replace(p[i], key="llm.s0:grad")

    with pytest.raises(ScheduleError, match=(
        r"r0->r1 mb2: shape key mismatch, rank 0 action #\d+ `SEND_A llm.s0 mb2 -> r1 \[llm.s0:act\]` "
        r"sends \[llm.s0:act\] but rank 1 action #\d+ `RECV_A llm.s1 mb2 .*` expects \[llm.s0:grad\]")):
        validate(edited(plan, 1, rekey))


def test_backward_before_forward():
    broken = swapped(one_f_one_b(), 1, "F      llm.s1 mb0", "B      llm.s1 mb0")
    with pytest.raises(ScheduleError, match=r"rank 1 action #\d+ `B      llm.s1 mb0`: needs forward of mb0"):
        validate(broken)


def test_forward_before_its_input_arrives_breaks_region_order():
    broken = swapped(one_f_one_b(), 1, "RECV_A llm.s1 mb1", "F      llm.s1 mb1")
    with pytest.raises(ScheduleError, match=r"rank 1 action #\d+ `F      llm.s1 mb1`: needs \[llm.s0:act\] of mb1"):
        validate(broken)


def test_send_before_the_tensor_is_computed():
    plan = one_f_one_b()
    i = index_of(plan, 0, "SEND_A llm.s0 mb0")
    broken = edited(plan, 0, lambda p: p.insert(0, p.pop(i)))
    with pytest.raises(ScheduleError, match=r"rank 0 action #0 `SEND_A llm.s0 mb0 .*`: needs \[llm.s0:act\] of mb0"):
        validate(broken)


def test_missing_and_duplicated_compute():
    plan = one_f_one_b()
    i = index_of(plan, 1, "B      llm.s1 mb3")
    with pytest.raises(ScheduleError, match=r"B llm.s1 mb3 runs 0 times on rank 1, expected once"):
        validate(edited(plan, 1, lambda p: p.pop(i)))
    with pytest.raises(ScheduleError, match=r"B llm.s1 mb3 runs 2 times on rank 1"):
        validate(edited(plan, 1, lambda p: p.insert(i, p[i])))


def test_compute_on_the_wrong_rank():
    plan = one_f_one_b()
    stray = plan.programs[1][index_of(plan, 1, "F      llm.s1 mb0")]
    with pytest.raises(ScheduleError, match=r"rank 0 action #0 .*llm.s1 mb0 is placed on rank 1, not 0"):
        validate(edited(plan, 0, lambda p: p.insert(0, stray)))


def test_backward_of_a_frozen_region_without_gradient_path():
    plan = compose([Region("vit", 2, Decoupled(ranks=1), trainable=False),
                    Region("llm", 4, OneFOneB(stages=2))], 2)
    forward = plan.programs[0][0]
    extra = dataclasses.replace(forward, kind=Kind.BACKWARD_INPUT)
    with pytest.raises(ScheduleError, match=r"unexpected I vit.s0 mb0: a frozen region without a gradient path"):
        validate(edited(plan, 0, lambda p: p.append(extra)))


def test_pool_get_without_a_put():
    plan = compose([Region("vit", 2, Decoupled(ranks=1)), Region("llm", 4, OneFOneB(stages=2))], 2)
    with pytest.raises(ScheduleError, match=r"rank 1 action #\d+ `GET    llm.s0 mb1 <- r0 \[vit.s0:act\]` waits for a put nobody makes"):
        validate(dropped(plan, 0, "PUT    vit.s0 mb1"))


def test_pool_get_naming_the_wrong_producer():
    plan = compose([Region("vit", 2, Decoupled(ranks=2)), Region("llm", 4, OneFOneB(stages=2))], 2)
    i = index_of(plan, 2, "GET    llm.s0 mb1 <- r1")

    def misaddress(p):
        p[i] = dataclasses.replace(p[i], peer=0)

    broken = edited(plan, 2, misaddress)
    with pytest.raises(ScheduleError, match=(
        r"rank 2 action #\d+ `GET    llm.s0 mb1 <- r0 \[vit.s0:act\]`: \[vit.s0:act\] mb1 is pooled "
        r"between this rank and rank 1 \(rank 1 action #\d+ `PUT    vit.s0 mb1 -> r2 .*`\), not r0")):
        validate(broken)


def test_collective_called_unequally():
    plan = compose([Region("vit", 2, Decoupled(ranks=2)), Region("llm", 4, OneFOneB(stages=2))], 2)
    with pytest.raises(ScheduleError, match=r"REDUCE vit group=\[0, 1\]: members call it unequally often \{0: 0, 1: 1\}"):
        validate(edited(plan, 0, lambda p: p.pop()))


def test_receive_cycle_deadlocks_under_both_semantics():
    plan = one_f_one_b(microbatches=2)
    # rank 0 waits for the gradient of mb0 before it sends mb0's activations
    order = ["F      llm.s0 mb0", "RECV_G llm.s0 mb0", "F      llm.s0 mb1", "SEND_A llm.s0 mb0",
             "SEND_A llm.s0 mb1", "B      llm.s0 mb0", "RECV_G llm.s0 mb1", "B      llm.s0 mb1"]
    by_text = {str(a).split(" <-")[0].split(" ->")[0]: a for a in plan.programs[0]}
    broken = dataclasses.replace(plan, programs={**plan.programs, 0: tuple(by_text[t] for t in order)})
    for semantics in ("eager", "rendezvous"):
        with pytest.raises(ScheduleError) as fault:
            validate(broken, semantics=semantics)
        message = str(fault.value)
        assert message.startswith(f"deadlock under {semantics} semantics: ")
        assert "rank 0 blocked at action #1 `RECV_G llm.s0 mb0 <- r1 [llm.s0:grad]`" in message
        assert "rank 1 blocked at action #0 `RECV_A llm.s1 mb0 <- r0 [llm.s0:act]`" in message


def test_eager_programs_with_early_sends_deadlock_under_blocking_sends():
    regions = [Region("vit", 2, Transpose(), trainable=False), Region("llm", 4, OneFOneB(stages=4))]
    eager = compose(regions, 8)
    validate(eager)  # isend: the transposed ViT may run ahead
    with pytest.raises(ScheduleError, match=r"deadlock under rendezvous semantics: rank \d+ blocked at action #\d+ `SEND_A"):
        validate(eager, semantics="rendezvous")
    validate(compose(regions, 8, semantics="rendezvous"))  # transfers in one global order


def test_unknown_semantics():
    with pytest.raises(ScheduleError, match="semantics must be one of"):
        validate(one_f_one_b(), semantics="magic")
