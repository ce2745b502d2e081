"""``DecoupledLayout`` in one process: roles, placement, the plan it composes, the world-size
check that names both numbers, and the model's layer counts kept apart from the sizes."""

from __future__ import annotations

import pytest

from mindspeed_flow.decoupled import DecoupledLayout, LayoutError
from mindspeed_flow.errors import FlowError


def test_decoupled_layout_roles_and_plan():
    layout = DecoupledLayout(encoder_dp=2, backbone_pp=2, max_ahead=1)
    plan = layout.plan(4)
    assert [layout.role(r) for r in range(4)] == [("vit", 0, 0), ("vit", 0, 0), ("llm", 0, 0), ("llm", 1, 0)]
    kinds = {r: [a.kind.value for a in p] for r, p in plan.programs.items()}
    assert kinds[0].count("PUT") == 2 and kinds[0].count("GET") == 2 and kinds[0][-1] == "REDUCE"
    assert "PUT" not in kinds[3] and "GET" not in kinds[3]
    with pytest.raises(ValueError, match="rank 4 outside"):
        layout.role(4)


def test_a_frozen_encoder_has_no_backward_in_the_plan():
    plan = DecoupledLayout(encoder_dp=1, backbone_pp=2).plan(2, trainable_encoder=False)
    assert not [a for a in plan.programs[0] if a.kind.value in ("B", "REDUCE")]


def test_the_world_size_check_names_both_numbers_and_the_source():
    layout = DecoupledLayout(encoder_dp=1, backbone_pp=2, backbone_dp=2)
    layout.check_world_size(6, "layout.yaml")
    with pytest.raises(LayoutError) as refused:
        layout.check_world_size(4, "layout.yaml")
    message = str(refused.value)
    assert message.startswith("layout.yaml: the decoupled layout needs 6 ranks")
    assert "the job's world size is 4" in message
    assert "encoder 2 = 2 replicas x tp 1, backbone 4 = dp 2 x pp 2 x tp 1" in message
    assert isinstance(refused.value, FlowError) and isinstance(refused.value, ValueError)


def test_layer_counts_come_from_the_model_apart_from_the_sizes():
    sizes = DecoupledLayout(encoder_dp=2, backbone_pp=2)
    model = sizes.with_layers(4, 6)
    assert (model.encoder_layers, model.backbone_layers) == (4, 6)
    assert model.world_size == sizes.world_size and model.role(3) == sizes.role(3)
    assert [r.num_layers for r in model.regions()] == [4, 6]


def test_a_slice_holds_every_tp_rank_of_both_roles_once():
    layout = DecoupledLayout(encoder_dp=2, encoder_tp=2, backbone_pp=2, backbone_tp=2, backbone_dp=2)
    slices = [layout.slice_ranks(r) for r in range(2)]
    assert sorted(slices[0] + slices[1]) == list(range(layout.world_size))
    for replica, ranks in enumerate(slices):
        assert {layout.replica(rank) for rank in ranks} == {replica}
        assert set(layout.replica_ranks(replica, 1, 1)) <= set(ranks)
    with pytest.raises(LayoutError, match="backbone replica 2 outside"):
        layout.slice_ranks(2)
