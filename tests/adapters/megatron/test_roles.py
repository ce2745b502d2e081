"""The decoupled layout's two Megatron configs (adapters/megatron/roles.py) and the model
built by role (adapters/mindspeed_mm/roles.py): the pure parts, without a world.  The
real job's groups, models and step are checked by tests/upstream/test_real_job_decoupled.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from mindspeed_flow.adapters.megatron import roles
from mindspeed_flow.adapters.mindspeed_mm.roles import configure_for_role
from mindspeed_flow.decoupled import DecoupledLayout
from mindspeed_flow.schedule.regions import BACKBONE_REGION, ENCODER_REGION


def layout(**fields):
    return DecoupledLayout(**fields)


def test_role_configs_split_the_world_encoder_first():
    encoder, backbone = roles.role_configs(layout(encoder_dp=1, backbone_pp=2, backbone_dp=2))
    assert (encoder.region, encoder.ranks, encoder.tp, encoder.pp, encoder.dp) == (ENCODER_REGION, (0, 1), 1, 1, 2)
    assert (backbone.region, backbone.ranks, backbone.pp, backbone.dp) == (BACKBONE_REGION, (2, 3, 4, 5), 2, 2)
    assert roles.my_role(layout(encoder_dp=1, backbone_pp=2, backbone_dp=2), 1).region == ENCODER_REGION
    assert roles.my_role(layout(encoder_dp=1, backbone_pp=2, backbone_dp=2), 3).region == BACKBONE_REGION


def test_a_world_that_is_not_the_layouts_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"this Megatron job: the decoupled layout needs 3 ranks .* world size is 2"):
        roles.check_world(layout(encoder_dp=1, backbone_pp=2, backbone_dp=1), 2)
    roles.check_world(layout(encoder_dp=1, backbone_pp=2, backbone_dp=1), 3)


@pytest.mark.parametrize("fields, parsed, reason", [
    ({"encoder_dp": 2}, {}, "encoder_dp 2 > 1 without --flow-packing"),
    ({}, {"overlap_grad_reduce": True}, "--overlap-grad-reduce"),
    ({"encoder_tp": 2}, {}, "encoder_tp 2 != backbone_tp 1"),
    ({}, {"save": "/ckpt", "ckpt_format": "torch_dist"}, "--save /ckpt with --ckpt-format torch_dist"),
    ({}, {"load": "/ckpt", "ckpt_format": "torch_dist"}, "--load /ckpt with --ckpt-format torch_dist"),
    ({"backbone_pp": 1}, {"save": "/ckpt", "ckpt_format": "torch"}, "--save /ckpt with backbone_pp 1"),
])
def test_what_this_version_does_not_run_is_refused_with_the_reason(fields, parsed, reason):
    with pytest.raises(ValueError, match=f"does not run here yet: .*{reason}"):
        roles.check_supported(layout(**fields), SimpleNamespace(**parsed), packing=False)
    roles.check_supported(layout(), SimpleNamespace(save=None, load=None), packing=False)
    roles.check_supported(layout(backbone_pp=2), SimpleNamespace(save="/ckpt", load="/ckpt", ckpt_format="torch"),
                          packing=False)


def test_a_global_batch_the_encoder_replicas_cannot_share_is_refused_naming_the_numbers():
    with pytest.raises(ValueError, match=r"2 encoder replicas per slice .*--global-batch-size 6 / "
                                         r"\(--micro-batch-size 1 x backbone dp 2\)\) to be a multiple of 2"):
        roles.check_encoder_share(layout(encoder_dp=2, backbone_dp=2), 6, 1)
    roles.check_encoder_share(layout(encoder_dp=2, backbone_dp=2), 8, 1)
    roles.check_encoder_share(layout(encoder_dp=1, backbone_dp=1), 3, 1)


def test_several_encoder_replicas_per_slice_run_with_the_packing_loader():
    """The plugin's loader gives every encoder replica its slice's packs (``loader_shard``)."""
    roles.check_supported(layout(encoder_dp=2), SimpleNamespace(save=None, load=None), packing=True)


def test_equal_tensor_parallel_sizes_in_both_roles_run():
    roles.check_supported(layout(encoder_tp=2, backbone_tp=2), SimpleNamespace(save=None, load=None), packing=True)


def test_role_world_answers_for_the_role_and_puts_torch_distributed_back():
    real = dist.get_world_size, dist.get_rank, dist.new_group
    encoder, backbone = roles.role_configs(layout(encoder_dp=1, backbone_pp=2, backbone_dp=1))
    with roles.role_world(backbone, 2):
        assert (dist.get_world_size(), dist.get_rank()) == (2, 1)
    with roles.role_world(backbone, 0):  # outside the role: answers as its first rank
        assert (dist.get_world_size(), dist.get_rank()) == (2, 0)
    assert (dist.get_world_size, dist.get_rank, dist.new_group) == real


def test_wrappers_are_megatrons_own_functions_without_a_layout():
    roles.configure(None)
    assert roles.validate_args_wrapper(lambda *a, **k: "own", None, (SimpleNamespace(),), {}) == "own"
    assert roles.initialize_model_parallel_wrapper(lambda *a, **k: "own", None, (1, 1), {}) == "own"


def model_config():
    vision = SimpleNamespace(pipeline_num_layers=[2, 0])
    return SimpleNamespace(image_encoder=SimpleNamespace(vision_encoder=vision), text_decoder=SimpleNamespace(),
                           audio_encoder=None)


def test_encoder_ranks_build_the_whole_vit_and_no_text_decoder():
    config = configure_for_role(model_config(), ENCODER_REGION)
    assert config.text_decoder is None and config.image_encoder.vision_encoder.pipeline_num_layers == [2]


def test_backbone_ranks_build_the_text_decoder_only_and_refuse_audio():
    config = configure_for_role(model_config(), BACKBONE_REGION)
    assert config.image_encoder is None and config.text_decoder is not None
    with_audio = model_config()
    with_audio.audio_encoder = SimpleNamespace()
    with pytest.raises(ValueError, match="audio encoder is not supported"):
        configure_for_role(with_audio, BACKBONE_REGION)
    with pytest.raises(ValueError, match="has none"):
        configure_for_role(SimpleNamespace(image_encoder=None, text_decoder=None), ENCODER_REGION)
