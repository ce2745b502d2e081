"""An allocator plan as a decoupled layout (one process): the mapping both ``mindspeed-flow
train`` and the real job's ``--flow-allocator-plan`` use, and why a runner cannot run a plan."""

from __future__ import annotations

import pytest

from mindspeed_flow.allocator import AllocationPlan, BackboneConfig, EncoderConfig, Prediction
from mindspeed_flow.decoupled import DecoupledLayout, LayoutError, describe_plan, layout_from_plan, unrealisable


def _plan(encoder_dp, backbone_pp, backbone_dp, *, tp=1, placement="decoupled"):
    split = [2 // backbone_pp or 1] * backbone_pp
    return AllocationPlan(EncoderConfig(encoder_dp, tp, 1), BackboneConfig(backbone_dp, tp, backbone_pp, 1, split), 4,
                          Prediction(1.0, 1.0, 1.0, 0.1, 0.0, 1.0, 4, 1.0, 1.0), placement=placement)


@pytest.mark.parametrize("plan, reason", [
    ((2, 2, 1), ""),
    ((4, 1, 2), "uses 6 of the 4 ranks"),
    ((2, 2, 1, "tp"), "tensor parallelism"),
    ((2, 2, 1, "colocated"), "co-located"),
    ((3, 1, 2), "3 encoder replicas do not split over its 2 backbone replicas"),
    ((1, 3, 1), "not a multiple of backbone_tp * backbone_pp = 3"),
], ids=["realisable", "devices", "tp", "colocated", "encoder-split", "megatron-blocks"])
def test_allocator_plans_flowtrain_cannot_run_say_why(plan, reason):
    sizes, kind = plan[:3], plan[3:]
    built = _plan(*sizes, tp=2 if kind == ("tp",) else 1,
                  placement="colocated" if kind == ("colocated",) else "decoupled")
    why = unrealisable(built, 4)
    assert (reason in why and why) if reason else why == ""


def test_a_plan_maps_to_the_layout_of_its_sizes():
    """The allocator counts encoder replicas over the job, the layout per backbone replica."""
    layout = layout_from_plan(_plan(4, 2, 2, tp=2), max_ahead=3)
    assert layout == DecoupledLayout(encoder_dp=2, encoder_tp=2, backbone_pp=2, backbone_tp=2, backbone_dp=2,
                                     max_ahead=3)
    assert layout.world_size == _plan(4, 2, 2, tp=2).devices
    assert layout_from_plan(_plan(1, 2, 1)).max_ahead == DecoupledLayout().max_ahead
    # A runner with tensor parallelism and its own groups per role takes what the CPU run refuses.
    assert unrealisable(_plan(2, 2, 1, tp=2), 8, tensor_parallel=True) == ""
    assert unrealisable(_plan(1, 3, 1), 4, megatron_blocks=False) == ""
    for bad, message in (((2, 2, 1, "colocated"), "co-located"), ((3, 1, 2), "do not split")):
        with pytest.raises(LayoutError, match=message):
            layout_from_plan(_plan(*bad[:3], placement=bad[3] if len(bad) > 3 else "decoupled"))


def test_describe_plan_names_its_shape():
    assert describe_plan(_plan(2, 2, 1)).startswith("decoupled: encoder dp=2 tp=1; backbone pp=2 dp=1 tp=1 layers [1, 1]")
