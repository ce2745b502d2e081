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
