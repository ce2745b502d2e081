"""The schedule algebra: regions, skeleton orders, seams, trainable bits, compose."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mindspeed_flow.schedule import (
    Action,
    Decoupled,
    GPipe,
    Interleaved1F1B,
    Kind,
    OneFOneB,
    Region,
    ScheduleError,
    Transpose,
    ZeroBubbleH1,
    ZeroBubbleV,
    compose,
    format_program,
    validate,
)
from mindspeed_flow.schedule.actions import COMPUTE
from mindspeed_flow.schedule.seams import P2P, SEAM_TABLE, SeamRule
from mindspeed_flow.schedule.skeletons import DECOUPLED, SHARDED, TRANSPOSED


def compute_order(plan, rank):
    return [f"{a.kind.value}{a.microbatch}" for a in plan.programs[rank] if a.kind in COMPUTE]


def kinds(plan, rank):
    return [a.kind for a in plan.programs[rank]]


# --------------------------------------------------------------------------- regions


def test_regions_must_cover_the_model_exactly():
    llm = OneFOneB(stages=2)
    with pytest.raises(ScheduleError, match=r"gap before region 'llm': layers 32\.\.33"):
        compose([Region("vit", 32, Transpose()), Region("llm", 8, llm, start=34)], 4)
    with pytest.raises(ScheduleError, match=r"region 'llm' overlaps .* layers 30\.\.31"):
        compose([Region("vit", 32, Transpose()), Region("llm", 8, llm, start=30)], 4)
    with pytest.raises(ScheduleError, match="cover layers 0..39 but the model has 41"):
        compose([Region("vit", 32, Transpose()), Region("llm", 8, llm)], 4, num_layers=41)
    with pytest.raises(ScheduleError, match="'llm' is used twice"):
        compose([Region("llm", 4, llm), Region("llm", 4, GPipe(stages=2))], 4)
    compose([Region("vit", 32, Transpose(), start=0), Region("llm", 8, llm, start=32)], 4, num_layers=40)


def test_shared_skeleton_layers_must_match_the_regions():
    shared = OneFOneB(stages=2, layers=(10, 10))
    with pytest.raises(ScheduleError, match="sums to 20 but regions \\['vit', 'llm'\\] have 24"):
        compose([Region("vit", 8, shared), Region("llm", 16, shared)], 4)
    with pytest.raises(ScheduleError, match="layers has 3 entries for 2"):
        OneFOneB(stages=2, layers=(1, 2, 3))


# --------------------------------------------------------------------------- skeleton orders


def test_1f1b_order_per_stage():
    plan = compose([Region("llm", 8, OneFOneB(stages=4))], 6)
    assert compute_order(plan, 0) == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    assert compute_order(plan, 3) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5"]


def test_1f1b_with_fewer_microbatches_than_stages():
    plan = compose([Region("llm", 4, OneFOneB(stages=4))], 2)
    assert compute_order(plan, 0) == ["F0", "F1", "B0", "B1"]
    validate(plan, semantics="rendezvous")


def test_gpipe_runs_all_forwards_first():
    plan = compose([Region("llm", 4, GPipe(stages=2))], 3)
    assert compute_order(plan, 0) == ["F0", "F1", "F2", "B0", "B1", "B2"]


def test_interleaved_follows_megatrons_virtual_microbatch_table():
    plan = compose([Region("llm", 8, Interleaved1F1B(stages=2, chunks_per_rank=2))], 4)
    rank0 = [f"{a.kind.value}{a.stage}.{a.microbatch}" for a in plan.programs[0] if a.kind in COMPUTE]
    # warm-up (2-0-1)*2 + (2-1)*2 = 4 virtual microbatches, groups of 2 microbatches
    assert rank0 == ["F0.0", "F0.1", "F2.0", "F2.1", "F0.2", "B2.0", "F0.3", "B2.1",
                     "F2.2", "B0.0", "F2.3", "B0.1", "B2.2", "B2.3", "B0.2", "B0.3"]
    assert plan.roles[1] == "llm.s1 + llm.s3"
    validate(plan)


def test_interleaved_refuses_what_megatron_refuses():
    with pytest.raises(ScheduleError, match="6 microbatches is not a multiple of 4 stages"):
        compose([Region("llm", 8, Interleaved1F1B(stages=4))], 6)
    with pytest.raises(ScheduleError, match="chunks_per_rank must be >= 2"):
        Interleaved1F1B(stages=2, chunks_per_rank=1)


# --------------------------------------------------------------------------- seams and layouts


def test_seam_table_has_a_rule_for_every_pair_that_can_meet():
    layouts = (SHARDED, TRANSPOSED, DECOUPLED)
    missing = {(a, b) for a in layouts for b in layouts} - set(SEAM_TABLE)
    assert missing == {(TRANSPOSED, TRANSPOSED)}  # equal skeletons merge into one segment
    assert all(rule.transport == "pool" for pair, rule in SEAM_TABLE.items() if DECOUPLED in pair)


def test_compose_takes_transports_and_hosts_from_the_seam_table(monkeypatch):
    head = [Region("llm", 4, OneFOneB(stages=2)), Region("head", 1, Decoupled(ranks=1))]
    assert {Kind.POOL_PUT, Kind.POOL_GET} <= set(kinds(compose(head, 2), 2))
    # one edit of the table turns every pool transfer at that seam into send/receive
    monkeypatch.setitem(SEAM_TABLE, (SHARDED, DECOUPLED), SeamRule(P2P))
    plan = compose(head, 2)
    assert set(kinds(plan, 2)) == {Kind.RECV_ACT, Kind.FORWARD, Kind.BACKWARD, Kind.SEND_GRAD}
    validate(plan, semantics="rendezvous")
    # a transposed region runs where the table says, or nowhere
    monkeypatch.setitem(SEAM_TABLE, (SHARDED, TRANSPOSED), SeamRule(P2P))
    with pytest.raises(ScheduleError, match="transposed region 'head' has no sharded neighbour"):
        compose([Region("llm", 4, OneFOneB(stages=2)), Region("head", 1, Transpose())], 2)
    monkeypatch.delitem(SEAM_TABLE, (TRANSPOSED, SHARDED))
    with pytest.raises(ScheduleError, match="no seam rule for transposed -> sharded"):
        compose([Region("vit", 2, Transpose()), Region("llm", 4, OneFOneB(stages=2))], 2)


def test_megatron_style_vit_inside_stage_zero():
    shared = OneFOneB(stages=2, layers=(6, 4))
    plan = compose([Region("vit", 4, shared, trainable=False), Region("llm", 6, shared)], 2)
    assert plan.roles == {0: "vit.s0 + llm.s0", 1: "llm.s1"}
    assert [str(a) for a in plan.programs[0][:3]] == [
        "F      vit.s0 mb0", "F      llm.s0 mb0", "SEND_A llm.s0 mb0 -> r1 [llm.s0:act]"]
    assert not any(a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and a.region == "vit"
                   for a in plan.programs[0])


def test_disttrain_style_encoder_stages_extend_the_pipeline():
    plan = compose([Region("vit", 4, OneFOneB(stages=1)), Region("llm", 8, OneFOneB(stages=2))], 4)
    assert plan.roles == {0: "vit.s0", 1: "llm.s1", 2: "llm.s2"}
    # one 3-stage 1F1B: the encoder stage warms up with 2 forwards, as stage 0 of three
    assert compute_order(plan, 0)[:4] == ["F0", "F1", "F2", "B0"]
    validate(plan, semantics="rendezvous")


def test_sharded_pipelines_of_different_orders_do_not_join():
    with pytest.raises(ScheduleError, match="seam 'vit' -> 'llm'.*OneFOneB pipeline .* not GPipe"):
        compose([Region("vit", 4, OneFOneB(stages=1)), Region("llm", 8, GPipe(stages=2))], 4)


def test_transpose_runs_microbatches_round_robin_on_the_pipeline_ranks():
    plan = compose([Region("vit", 4, Transpose(), trainable=False), Region("llm", 8, OneFOneB(stages=2))], 4)
    vit = {rank: [a.microbatch for a in plan.programs[rank] if a.region == "vit" and a.kind is Kind.FORWARD]
           for rank in plan.programs}
    assert vit == {0: [0, 2], 1: [1, 3]}
    sends = [a for a in plan.programs[1] if a.kind is Kind.SEND_ACT and a.region == "vit"]
    assert [(a.microbatch, a.peer, a.key) for a in sends] == [(1, 0, "vit.s0:act"), (3, 0, "vit.s0:act")]
    # the owner of mb0 is stage 0 itself: nothing travels
    assert not any(a.kind is Kind.RECV_ACT and a.microbatch in (0, 2) for a in plan.programs[0])


def test_transposed_head_after_the_pipeline_borrows_its_ranks():
    regions = [Region("llm", 4, OneFOneB(stages=2)), Region("head", 1, Transpose())]
    plan = compose(regions, 4)
    assert plan.roles == {0: "llm.s0 + head(transposed)", 1: "llm.s1 + head(transposed)"}
    # the head's backward follows its forward; it does not wait for later forwards
    assert compute_order(plan, 0)[:4] == ["F0", "F1", "F0", "B0"]
    validate(plan)
    validate(compose(regions, 4, semantics="rendezvous"))


def test_replicated_skeleton_options_are_keywords():
    assert Decoupled(2).ranks == 2 and Decoupled(2).max_in_flight is None
    assert Transpose() == Transpose(max_in_flight=None) != Transpose(max_in_flight=4)
    with pytest.raises(ScheduleError, match="max_in_flight must be >= 1"):
        Decoupled(ranks=1, max_in_flight=0)


def test_rendezvous_keeps_just_in_time_transfers_where_they_are_safe():
    pipeline = [Region("llm", 8, OneFOneB(stages=4))]
    assert compose(pipeline, 8, semantics="rendezvous").programs == compose(pipeline, 8).programs
    transposed = [Region("vit", 2, Transpose(), trainable=False), Region("llm", 8, OneFOneB(stages=4))]
    assert compose(transposed, 8, semantics="rendezvous").programs != compose(transposed, 8).programs


def test_transpose_without_a_sharded_neighbour_is_an_error():
    with pytest.raises(ScheduleError, match="transposed region 'vit' has no sharded neighbour"):
        compose([Region("vit", 4, Transpose()), Region("llm", 8, Decoupled(ranks=2))], 4)


def test_decoupled_producer_talks_only_through_the_pool():
    plan = compose([Region("vit", 4, Decoupled(ranks=2)), Region("llm", 8, OneFOneB(stages=2))], 4)
    assert plan.roles == {0: "vit(decoupled)", 1: "vit(decoupled)", 2: "llm.s0", 3: "llm.s1"}
    producer = kinds(plan, 0)
    assert Kind.POOL_PUT in producer and Kind.POOL_GET in producer  # activations out, grads back
    assert not {Kind.SEND_ACT, Kind.RECV_GRAD, Kind.SEND_GRAD, Kind.RECV_ACT} & set(producer)
    gets = [str(a) for a in plan.programs[2] if a.kind is Kind.POOL_GET]
    assert gets[0] == "GET    llm.s0 mb0 <- r0 [vit.s0:act]"
    # trainable replicas reduce gradients, and start from the same parameters
    assert producer[0] is Kind.PARAM_BROADCAST and producer[-1] is Kind.GRAD_REDUCE


# --------------------------------------------------------------------------- trainable bits


def _backwards(plan):
    return {(a.region, a.kind.value) for p in plan.programs.values() for a in p
            if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT)}


def test_trainable_bits_decide_backward_work_and_gradient_traffic():
    def regions(vit, proj, llm):
        return [Region("vit", 4, Decoupled(ranks=2), trainable=vit),
                Region("proj", 1, Decoupled(ranks=2), trainable=proj),
                Region("llm", 8, OneFOneB(stages=2), trainable=llm)]

    end_to_end = compose(regions(True, True, True), 4)
    projector_only = compose(regions(False, True, False), 4)
    frozen_encoder = compose(regions(False, False, True), 4)
    assert _backwards(end_to_end) == {("vit", "B"), ("proj", "B"), ("llm", "B")}
    # the gradient must cross the frozen LLM to reach the projector: input grads only there
    assert _backwards(projector_only) == {("proj", "B"), ("llm", "I")}
    assert _backwards(frozen_encoder) == {("llm", "B")}
    # no gradient goes back into a region without a backward pass
    grads = {a.key for p in frozen_encoder.programs.values() for a in p if a.key.endswith(":grad")}
    assert grads == {"llm.s0:grad"}
    assert not any(a.kind is Kind.GRAD_REDUCE for p in frozen_encoder.programs.values() for a in p)
    for plan in (end_to_end, projector_only, frozen_encoder):
        validate(plan, semantics="rendezvous")


# --------------------------------------------------------------------------- actions


def test_action_is_a_frozen_value_printing_one_line():
    action = Action(Kind.SEND_GRAD, "llm", 2, 5, peer=1, key="llm.s1:grad")
    assert str(action) == "SEND_G llm.s2 mb5 -> r1 [llm.s1:grad]"
    assert action == Action(Kind.SEND_GRAD, "llm", 2, 5, peer=1, key="llm.s1:grad")
    with pytest.raises(AttributeError):
        action.microbatch = 6
    assert str(Action(Kind.GRAD_REDUCE, "vit", group=(0, 1))) == "REDUCE vit.s0 group=[0, 1]"
    assert format_program(3, [action]) == "r3 #0   SEND_G llm.s2 mb5 -> r1 [llm.s1:grad]"


def test_plan_prints_every_rank():
    plan = compose([Region("llm", 2, OneFOneB(stages=2))], 1)
    assert plan.format().splitlines() == [
        "# rank 0: llm.s0",
        "r0 #0   F      llm.s0 mb0",
        "r0 #1   SEND_A llm.s0 mb0 -> r1 [llm.s0:act]",
        "r0 #2   RECV_G llm.s0 mb0 <- r1 [llm.s0:grad]",
        "r0 #3   B      llm.s0 mb0",
        "# rank 1: llm.s1",
        "r1 #0   RECV_A llm.s1 mb0 <- r0 [llm.s0:act]",
        "r1 #1   F      llm.s1 mb0",
        "r1 #2   B      llm.s1 mb0",
        "r1 #3   SEND_G llm.s1 mb0 -> r0 [llm.s0:grad]",
    ]


# --------------------------------------------------------------------------- any composition


def _skeleton(kind, stages, ranks):
    return {
        "1f1b": OneFOneB(stages=stages),
        "gpipe": GPipe(stages=stages),
        "transpose": Transpose(),
        "decoupled": Decoupled(ranks=ranks),
        "interleaved": Interleaved1F1B(stages=stages),
        "zb-h1": ZeroBubbleH1(stages=stages),
        "zb-v": ZeroBubbleV(stages=stages),
    }[kind]


@settings(max_examples=40, deadline=None)
@given(
    encoder=st.sampled_from(["1f1b", "transpose", "decoupled"]),
    backbone=st.sampled_from(["1f1b", "gpipe", "interleaved", "zb-h1", "zb-v"]),
    stages=st.integers(1, 4),
    ranks=st.integers(1, 3),
    microbatches=st.integers(1, 9),
    trainable=st.tuples(st.booleans(), st.booleans()),
    semantics=st.sampled_from(["eager", "rendezvous"]),
)
def test_every_composition_validates(encoder, backbone, stages, ranks, microbatches, trainable, semantics):
    if encoder == "1f1b" and backbone != "1f1b":
        encoder = "transpose"  # only equal non-interleaved orders join into one pipeline
    if backbone == "interleaved":
        microbatches *= stages  # Megatron's microbatch groups
    regions = [
        Region("vit", 3, _skeleton(encoder, 1, ranks), trainable=trainable[0]),
        Region("llm", 4 * stages, _skeleton(backbone, stages, ranks), trainable=trainable[1]),
    ]
    plan = compose(regions, microbatches, semantics=semantics)
    validate(plan)
    validate(plan, semantics="eager")
