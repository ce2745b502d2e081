"""The validator on programs broken on purpose: each fault is caught and named."""

from __future__ import annotations

import dataclasses

import pytest

from mindspeed_flow.schedule import (
    Action,
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


# --------------------------------------------------------------------------- collectives (issue 13)


def transposed_vit(trainable=True, window=None):
    """A ViT replicated over the four ranks of a 1F1B LLM: four replicas."""
    return compose([Region("vit", 2, Transpose(max_in_flight=window), trainable=trainable),
                    Region("llm", 4, OneFOneB(stages=4))], 8)


def rewritten(plan, rewrite):
    """The plan with ``rewrite(rank, list_of_actions)`` applied to every rank's program."""
    programs = {}
    for rank, program in plan.programs.items():
        program = list(program)
        rewrite(rank, program)
        programs[rank] = tuple(program)
    return dataclasses.replace(plan, programs=programs)


def without_collectives(rank, program):
    program[:] = [a for a in program if a.kind not in (Kind.PARAM_BROADCAST, Kind.GRAD_REDUCE)]


def test_replicated_trainable_region_without_broadcast_and_reduce():
    with pytest.raises(ScheduleError, match=(
            r"rank 0 has no gradient reduce of trainable replicated region 'vit': "
            r"expected one `REDUCE vit.s0 group=\[0, 1, 2, 3\]` after its last backward")):
        validate(rewritten(transposed_vit(), without_collectives))


def test_reduce_over_part_of_the_replicas():
    def only_ranks_0_and_1(rank, program):
        if rank < 2:
            program[-1] = dataclasses.replace(program[-1], group=(0, 1))
        else:
            program.pop()

    with pytest.raises(ScheduleError, match=(
            r"rank 0 action #\d+ `REDUCE vit.s0 group=\[0, 1\]`: group \[0, 1\] is not the replica "
            r"group \[0, 1, 2, 3\] of region 'vit'")):
        validate(rewritten(transposed_vit(), only_ranks_0_and_1))


def test_a_frozen_replicated_region_has_no_collectives():
    def reduce_frozen(rank, program):
        program.append(Action(Kind.GRAD_REDUCE, "vit", group=(0, 1, 2, 3)))

    with pytest.raises(ScheduleError, match=(
            r"rank 0 action #\d+ `REDUCE vit.s0 group=\[0, 1, 2, 3\]`: region 'vit' is frozen: "
            r"its replicas have no gradient reduce")):
        validate(rewritten(transposed_vit(trainable=False), reduce_frozen))


def test_no_reduce_across_pipeline_stages():
    def reduce_llm(rank, program):
        program.append(Action(Kind.GRAD_REDUCE, "llm", group=(0, 1, 2, 3)))

    with pytest.raises(ScheduleError, match=(
            r"rank 0 action #\d+ `REDUCE llm.s0 group=\[0, 1, 2, 3\]`: region 'llm' is sharded "
            r"\(one copy of each layer\): no gradient reduce across its pipeline stages")):
        validate(rewritten(transposed_vit(), reduce_llm))


def test_a_single_replica_has_no_collectives():
    plan = compose([Region("vit", 2, Decoupled(ranks=1)), Region("llm", 4, OneFOneB(stages=2))], 2)
    broadcast = Action(Kind.PARAM_BROADCAST, "vit", group=(0,))
    with pytest.raises(ScheduleError, match=r"region 'vit' has a single replica: there is nothing to bcast"):
        validate(edited(plan, 0, lambda p: p.insert(0, broadcast)))


def test_a_collective_per_microbatch():
    def per_microbatch(rank, program):
        program[-1] = dataclasses.replace(program[-1], microbatch=0)

    with pytest.raises(ScheduleError, match=(
            r"rank 0 action #\d+ `REDUCE vit.s0 mb0 group=\[0, 1, 2, 3\]`: a collective covers the whole "
            r"replicated region once per step: stage 0, no microbatch, peer or key")):
        validate(rewritten(transposed_vit(), per_microbatch))


def test_a_collective_twice_on_a_member():
    plan = transposed_vit()
    with pytest.raises(ScheduleError, match=r"rank 0 action #\d+ `REDUCE vit.s0 .*`: rank 0 runs .* 2 times, expected once per step"):
        validate(rewritten(plan, lambda rank, p: p.append(p[-1])))


@pytest.mark.parametrize("semantics", ["eager", "rendezvous"])
def test_reduce_before_the_last_backward_on_every_member(semantics):
    def reduce_first(rank, program):
        program.insert(1, program.pop())  # right after the broadcast

    plan = compose([Region("vit", 2, Transpose()), Region("llm", 4, OneFOneB(stages=4))], 8, semantics=semantics)
    with pytest.raises(ScheduleError, match=(
            r"rank 0 action #1 `REDUCE vit.s0 group=\[0, 1, 2, 3\]`: the gradient reduce comes before "
            r"rank 0 action #\d+ `B      vit.s0 mb4`; it must follow the region's last backward")):
        validate(rewritten(plan, reduce_first), semantics=semantics)


def test_broadcast_after_the_first_forward_on_every_member():
    def broadcast_late(rank, program):
        program.insert(len(program) - 1, program.pop(0))  # just before the reduce

    with pytest.raises(ScheduleError, match=(
            r"rank 0 action #\d+ `BCAST  vit.s0 group=\[0, 1, 2, 3\]`: the parameter broadcast comes "
            r"after rank 0 action #0 `F      vit.s0 mb0`; it must precede the region's first forward")):
        validate(rewritten(transposed_vit(), broadcast_late))


def test_plan_claiming_a_window_its_programs_do_not_keep():
    unbounded = transposed_vit(window=None)
    claimed = dataclasses.replace(unbounded, regions=transposed_vit(window=1).regions)
    validate(transposed_vit(window=1))
    with pytest.raises(ScheduleError, match=(
            r"rank \d action #\d+ `F      vit.s0 mb\d`: rank \d would hold 2 microbatches in flight "
            r"\[\d, \d\], more than max_in_flight=1 of Transpose")):
        validate(claimed)


@pytest.mark.parametrize("drop, message", [
    ("RECV_A llm.s1 mb1", r"rank 0 action #\d+ `SEND_A llm.s0 mb1 -> r1 \[llm.s0:act\]` has no matching receive on "
                          r"rank 1: missing `RECV_A llm.s1 mb1 <- r0 \[llm.s0:act\]`"),
    ("SEND_G llm.s1 mb0", r"rank 0 action #\d+ `RECV_G llm.s0 mb0 <- r1 \[llm.s0:grad\]` has no matching send on "
                          r"rank 1: missing `SEND_G llm.s1 mb0 -> r0 \[llm.s0:grad\]`"),
])
def test_a_dropped_end_is_named_not_the_fifo_drift_it_causes(drop, message):
    with pytest.raises(ScheduleError, match=message):
        validate(dropped(one_f_one_b(), 1, drop))


def test_no_composed_replicated_plan_is_rejected():
    """The collective and window checks accept everything compose makes: every replicated
    layout, replica count, window, trainable bits, microbatch count and semantics."""
    checked = 0
    for encoder in (Transpose, Decoupled):
        for replicas in ((2, 3) if encoder is Decoupled else (1, 3)):
            for window in (None, 1, 2):
                for trainable in ((True, True), (True, False), (False, True)):
                    for microbatches in (1, 2, 5):
                        skeleton = (Decoupled(ranks=replicas, max_in_flight=window) if encoder is Decoupled
                                    else Transpose(max_in_flight=window))
                        regions = [Region("vit", 2, skeleton, trainable=trainable[0]),
                                   Region("proj", 1, skeleton, trainable=trainable[1]),
                                   Region("llm", 4, OneFOneB(stages=replicas))]
                        for semantics in ("eager", "rendezvous"):
                            try:
                                plan = compose(regions, microbatches, semantics=semantics)
                            except ScheduleError as error:  # a window too small to order
                                assert "cannot be merged" in str(error)
                                continue
                            validate(plan)
                            checked += 1
    assert checked > 100
