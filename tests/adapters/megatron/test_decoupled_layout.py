"""``decoupled_layout(args)``: the one decoupled layout a Megatron / MindSpeed-MM job's flags
name (the layout file's ``decoupled:`` form or a decoupled allocator plan written by
``mindspeed-flow plan``), the world size checked against it naming both numbers, and the
start-up refusal while the ``decoupled`` feature is not on."""

from __future__ import annotations

import argparse

import pytest

from mindspeed_flow.adapters.megatron import allocator_plan
from mindspeed_flow.allocator import AllocatorError
from mindspeed_flow.adapters.megatron.decoupled_layout import decoupled_layout, refuse_without_decoupled_step
from mindspeed_flow.config import add_flow_arguments
from mindspeed_flow.decoupled import DecoupledLayout, LayoutError
from mindspeed_flow.runtime.layout import load_decoupled
from cli_plans import cli_plan, runnable_config


def args(*flags: str, world_size: int | None = None) -> argparse.Namespace:
    """Megatron's ``args`` as far as the plugin reads them: its flags parsed, the world size."""
    parsed = add_flow_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(list(flags))
    parsed.world_size = world_size
    return parsed


def layout_file(tmp_path, text: str):
    path = tmp_path / "layout.yaml"
    path.write_text(text + "\n")
    return path


def test_no_decoupled_flag_no_layout(tmp_path):
    assert decoupled_layout(args()) is None
    regions = layout_file(tmp_path, "regions:\n  - {name: llm, layers: 4}")
    assert decoupled_layout(args("--flow-schedule-config", str(regions), world_size=2)) is None
    assert refuse_without_decoupled_step(args("--flow-schedule-config", str(regions))) is None


def test_the_layout_files_decoupled_form_at_its_world_size(tmp_path):
    path = layout_file(tmp_path, "decoupled: {encoder: {dp: 1, tp: 1}, backbone: {dp: 1, tp: 1, pp: 2}, "
                                 "max_in_flight: 2}")
    assert decoupled_layout(args("--flow-schedule-config", str(path), world_size=3)) == DecoupledLayout(
        encoder_dp=1, backbone_pp=2, max_ahead=2)
    with pytest.raises(LayoutError) as refused:
        decoupled_layout(args("--flow-schedule-config", str(path), world_size=4))
    message = str(refused.value)
    assert message.startswith(f"{path}: the decoupled layout needs 3 ranks") and "world size is 4" in message


def test_a_decoupled_plan_from_the_cli_is_exactly_its_layout(tmp_path, tmp_path_factory):
    """A plan written by `mindspeed-flow plan` gives the layout of a `decoupled:` file with
    the plan's sizes; at another world size the start-up error names both numbers."""
    plan_path, plan, _ = cli_plan(runnable_config(tmp_path_factory), 3, tmp_path_factory)
    assert plan.placement == "decoupled"
    e, b = plan.encoder, plan.backbone
    file = layout_file(tmp_path, f"decoupled: {{encoder: {{dp: {e.dp}, tp: {e.tp}}}, "
                                 f"backbone: {{dp: {b.dp}, tp: {b.tp}, pp: {b.pp}}}}}")
    flags = ("--flow-allocator", "--flow-allocator-plan", str(plan_path))
    layout = decoupled_layout(args(*flags, world_size=plan.devices))
    assert layout == load_decoupled(file) and layout.world_size == plan.devices == 3
    with pytest.raises(LayoutError, match=rf"{plan_path}: the decoupled layout needs 3 ranks .* world size is 5"):
        decoupled_layout(args(*flags, world_size=5))
    # the file and the plan together: the same sizes are one layout, other sizes are refused naming both
    assert decoupled_layout(args(*flags, "--flow-schedule-config", str(file), world_size=3)) == layout
    other = layout_file(tmp_path, "decoupled: {encoder: {dp: 2}, backbone: {pp: 2}}")
    with pytest.raises(LayoutError, match=rf"{other} and {plan_path} name two decoupled layouts"):
        decoupled_layout(args(*flags, "--flow-schedule-config", str(other)))
    # without --flow-allocator the plan is not read
    assert decoupled_layout(args("--flow-allocator-plan", str(plan_path), world_size=3)) is None


def test_a_plan_no_decoupled_layout_runs_is_refused_naming_the_file(tmp_path_factory):
    """The unconstrained best plan of the tiny config at 3 devices feeds 2 backbone replicas
    from 1 encoder replica: no ``DecoupledLayout`` (each replica its own encoders) runs it."""
    plan_path, plan, _ = cli_plan("tiny_cpu.yaml", 3, tmp_path_factory)
    assert plan.placement == "decoupled" and plan.encoder.dp % plan.backbone.dp
    with pytest.raises(LayoutError, match=rf"{plan_path}: the plan's {plan.encoder.dp} encoder replicas do not "
                                          rf"split over its {plan.backbone.dp} backbone replicas"):
        decoupled_layout(args("--flow-allocator", "--flow-allocator-plan", str(plan_path), world_size=3))


def test_without_the_pool_feature_the_job_is_refused_at_start_up(tmp_path, tmp_path_factory):
    """Megatron's ``validate_args`` under the allocator patch: a decoupled plan, or a decoupled
    layout file, is refused with the reason (never run co-located), naming the plan's devices
    and the job's world size."""
    plan_path, plan, _ = cli_plan(runnable_config(tmp_path_factory), 3, tmp_path_factory)
    called = []
    for world in (3, 2):
        namespace = args("--flow-allocator", "--flow-allocator-plan", str(plan_path), world_size=world)
        with pytest.raises(AllocatorError) as refused:
            allocator_plan.validate_args_wrapper(lambda *a, **k: called.append(a), None, (namespace, {}), {})
        message = str(refused.value)
        assert f"{plan.devices} devices in all (this job: world size {world})" in message
        assert "only with the plugin's `pool` feature (--flow-pool or --use-flowtrain), which is not on" in message
    assert not called
    file = layout_file(tmp_path, "decoupled: {encoder: {dp: 1}, backbone: {pp: 2}}")
    with pytest.raises(LayoutError) as refused:
        refuse_without_decoupled_step(args("--flow-schedule-config", str(file), world_size=3))
    message = str(refused.value)
    assert message.startswith(f"{file}: a decoupled layout (encoder dp 1 x tp 1, backbone dp 1 x tp 1 x pp 2, "
                              "3 ranks) needs the plugin's `pool` feature")
    assert "would otherwise run co-located" in message


def test_the_flow_switch_is_read_and_what_the_flow_does_not_run_is_refused_naming_the_file(tmp_path):
    """``flow: true`` (issue 23) under ``decoupled:``: the layout runs FlowTrain's flow with its
    encoder batch size; a flow layout the real job does not run yet (here: two backbone
    replicas of two encoder replicas each, and TP 2) is refused at start-up naming the file and each reason."""
    path = layout_file(tmp_path, "decoupled: {encoder: {dp: 1}, backbone: {pp: 2}, flow: true, "
                                 "flow_encoder_batch_patches: 64, flow_max_in_flight: 6}")
    assert decoupled_layout(args("--flow-schedule-config", str(path), world_size=3)) == DecoupledLayout(
        encoder_dp=1, backbone_pp=2, flow=True, flow_encoder_batch_patches=64, flow_max_in_flight=6)
    assert not load_decoupled(layout_file(tmp_path, "decoupled: {encoder: {dp: 1}, backbone: {pp: 2}}")).flow
    wide = layout_file(tmp_path, "decoupled: {encoder: {dp: 4, tp: 2}, backbone: {dp: 2, pp: 2, tp: 2}, flow: true}")
    with pytest.raises(LayoutError) as refused:
        decoupled_layout(args("--flow-schedule-config", str(wide), world_size=16))
    message = str(refused.value)
    assert message.startswith(f"{wide}: decoupled.flow does not run here yet") and \
        "backbone dp 2 with 2 encoder replicas per slice" in message
    assert "tensor parallelism (encoder tp 2, backbone tp 2" in message
