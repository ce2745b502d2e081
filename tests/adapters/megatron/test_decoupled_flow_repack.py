"""The decoupled layout's ``flow_repack`` (the LLM's microbatches made again from the flow's
samples instead of the packing loader's packs): read from the layout file's ``decoupled:``
section, off by default, only with ``flow``, and refused at start-up without
``--calculate-per-token-loss`` (without it a regrouped step is another loss), naming the file,
the key and the flag.  What a regrouped pack holds: ``tests/adapters/mindspeed_mm/test_flow_repack.py``;
the job: ``tests/upstream/test_real_job_flow_repack.py``."""

from __future__ import annotations

import pytest

from mindspeed_flow.adapters.megatron.decoupled_layout import decoupled_layout
from mindspeed_flow.decoupled import DecoupledLayout, LayoutError
from mindspeed_flow.schedule import ScheduleError
from mindspeed_flow.runtime.layout import load_decoupled

from tests.adapters.megatron.test_decoupled_layout import args, layout_file

FLOW = "decoupled: {encoder: {dp: 1}, backbone: {pp: 2}, flow: true"


def test_flow_repack_is_read_off_by_default_and_needs_per_token_loss(tmp_path):
    assert not load_decoupled(layout_file(tmp_path, FLOW + "}")).flow_repack
    path = layout_file(tmp_path, FLOW + ", flow_repack: true}")
    per_token = args("--flow-schedule-config", str(path), world_size=3)
    per_token.calculate_per_token_loss = True
    assert decoupled_layout(per_token) == DecoupledLayout(encoder_dp=1, backbone_pp=2, flow=True, flow_repack=True)
    with pytest.raises(LayoutError) as refused:
        decoupled_layout(args("--flow-schedule-config", str(path), world_size=3))
    message = str(refused.value)
    assert message.startswith(f"{path}: decoupled.flow_repack") and "--calculate-per-token-loss" in message


def test_flow_repack_without_the_flow_is_refused_naming_the_file(tmp_path):
    path = layout_file(tmp_path, "decoupled: {encoder: {dp: 1}, backbone: {pp: 2}, flow_repack: true}")
    with pytest.raises(ScheduleError, match=f"{path}.*flow_repack: true regroups the flow's samples: it needs "
                                            "flow: true"):
        load_decoupled(path)
    with pytest.raises(LayoutError, match="flow_repack regroups the flow's samples: it needs flow"):
        DecoupledLayout(flow_repack=True)


def test_repacking_over_two_slices_deals_over_them_and_shares_one_pool_name():
    """With several backbone replicas ``flow_repack`` deals each step over all of them, so
    every slice opens the one pool ``<name>-b``; without it each slice has ``<name>-b<slice>``."""
    from mindspeed_flow.adapters.megatron.decoupled_flow import dealt_replicas, grouping_replica

    dealing = DecoupledLayout(encoder_dp=1, backbone_pp=1, backbone_dp=2, flow=True, flow_repack=True)
    own = DecoupledLayout(encoder_dp=1, backbone_pp=1, backbone_dp=2, flow=True)
    assert dealing.deals_over_slices and not own.deals_over_slices
    assert not DecoupledLayout(flow=True, flow_repack=True).deals_over_slices  # one slice: nothing to deal over
    assert (dealt_replicas(dealing), dealt_replicas(own)) == (2, 1)
    # ranks 0, 1: the slices' ViT ranks; 2, 3: their LLM ranks
    assert [grouping_replica(dealing, r) for r in range(4)] == [0, 1, 0, 1]
    assert [grouping_replica(own, r) for r in range(4)] == [0, 0, 0, 0]


def test_repacking_over_two_slices_is_refused_on_the_torch_pool_backend(tmp_path):
    path = layout_file(tmp_path, "decoupled: {encoder: {dp: 2}, backbone: {pp: 1, dp: 2}, flow: true, "
                                 "flow_repack: true}")
    job = args("--flow-schedule-config", str(path), "--flow-pool-backend", "torch", world_size=4)
    job.calculate_per_token_loss = True
    with pytest.raises(LayoutError, match=f"{path}: decoupled.flow does not run here yet: flow_repack over 2 backbone "
                                          "replicas on the torch pool backend"):
        decoupled_layout(job)
    shm = args("--flow-schedule-config", str(path), "--flow-pool-backend", "shm", world_size=4)
    shm.calculate_per_token_loss = True
    assert decoupled_layout(shm).deals_over_slices
