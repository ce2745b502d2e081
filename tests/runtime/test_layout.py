"""Layouts the schedule feature runs (Megatron's own, YAML, MindSpeed-MM's VLM split), the
chunks a rank binds, and the start-up refusal of features that swap the same schedule."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace

import pytest

from mindspeed_flow.adapters.megatron import schedule as adapter
from mindspeed_flow.runtime.layout import load_layout, local_visits, megatron_layout, plan_for, vlm_layout
from mindspeed_flow.schedule import Interleaved1F1B, OneFOneB, ScheduleError, Transpose


def test_megatron_layout_is_1f1b_or_interleaved_and_binds_chunks_in_model_order():
    (region,) = megatron_layout(4)
    assert region.skeleton == OneFOneB(stages=4)
    (region,) = megatron_layout(2, chunks=2)
    assert region.skeleton == Interleaved1F1B(stages=2, chunks_per_rank=2)
    plan = plan_for(megatron_layout(2, 2), 4)
    assert local_visits(plan, 0) == [("model", 0), ("model", 2)]  # Megatron's model list order
    assert local_visits(plan, 1) == [("model", 1), ("model", 3)]


def test_yaml_layout(tmp_path):
    path = tmp_path / "layout.yaml"
    path.write_text("regions:\n"
                    "  - {name: vit, layers: 2, skeleton: transpose, trainable: false, max_in_flight: 2}\n"
                    "  - {name: llm, layers: 4, skeleton: 1f1b, pipeline_num_layers: [1, 3]}\n")
    vit, llm = load_layout(path, stages=2)
    assert (vit.name, vit.trainable, vit.skeleton) == ("vit", False, Transpose(max_in_flight=2))
    assert llm.skeleton == OneFOneB(stages=2, layers=(1, 3))
    assert local_visits(plan_for((vit, llm), 4), 1) == [("vit", 0), ("llm", 1)]


@pytest.mark.parametrize("text, message", [
    ("regions: []\n", "expected a non-empty `regions:` list"),
    ("regions:\n  - {name: llm}\n", r"regions\[0\]: needs at least `name` and `layers`"),
    ("regions:\n  - {name: llm, layers: 2, skeleton: pipedream}\n", r"regions\[0\] \(llm\): unknown skeleton 'pipedream'"),
    ("regions:\n  - {name: llm, layers: 2, stage: 2}\n", r"unknown key regions\[0\] \(llm\)\.stage \(known in regions\[0\] \(llm\): name, "),
    ("regions:\n  - {name: llm, layers: 2, pipeline_num_layers: [1, 1, 1]}\n", r"regions\[0\] \(llm\): .*3 entries"),
    ("regions: [\n", "cannot read the schedule layout"),
])
def test_bad_yaml_names_the_file_and_region(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ScheduleError, match=message) as failure:
        load_layout(path, stages=2)
    assert str(path) in str(failure.value)


def test_vlm_split_of_mindspeed_mm():
    # MindSpeed-MM's own placement (ViT inside stage 0) is Megatron's layout: numbers unchanged
    assert vlm_layout([3, 0], [1, 3]) == megatron_layout(2)
    vit, llm = vlm_layout([3, 0], [1, 3], transpose=True, vision_trainable=False)
    assert (vit.num_layers, vit.trainable, llm.skeleton) == (3, False, OneFOneB(stages=2, layers=(1, 3)))
    with pytest.raises(ScheduleError, match="vision_encoder.pipeline_num_layers has 2 stages but text_decoder"):
        vlm_layout([3, 0], [1, 1, 2])


def test_vlm_layout_from_mindspeed_mm_args(tmp_path):
    path = tmp_path / "vlm.yaml"
    path.write_text("vlm: {transpose: true, vision_trainable: false}\n")
    model = SimpleNamespace(image_encoder=SimpleNamespace(vision_encoder=SimpleNamespace(pipeline_num_layers=[4, 0])),
                            text_decoder=SimpleNamespace(pipeline_num_layers=[2, 2]))
    args = argparse.Namespace(flow_schedule_config=str(path))
    layout = adapter.layout_from_args(args)
    with pytest.raises(ValueError, match="needs MindSpeed-MM's model config"):
        layout(2, 1)
    args.mm = SimpleNamespace(model=model)  # what merge_mm_args adds after validate_args
    vit, llm = layout(2, 1)
    assert (vit.num_layers, vit.trainable, llm.skeleton.layers) == (4, False, (2, 2))
    assert adapter.layout_from_args(argparse.Namespace(flow_schedule_config=None)) is None


@pytest.mark.parametrize("flags, named", [
    ({"schedules_method": "dualpipev"}, "MindSpeed DualPipeV"),
    ({"recompute_in_bubble": True}, "MindSpeed RiPipe"),
    ({"hetero_parallel": True}, "MindSpeed-MM --hetero-parallel"),
    ({"optimize_send_recv_comm": True}, "MindSpeed --optimize-send-recv-comm"),
    ({"use_multiparameter_pipeline_model_parallel": True}, "MindSpeed --use-multiparameter-pipeline"),
    ({"dist_train": True}, "MindSpeed --dist-train"),
    ({"moe_fb_overlap": True, "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
     "MindSpeed --moe-fb-overlap"),
    ({"layerwise_disaggregated_training": True}, "MindSpeed-MM layerwise_disaggregated_training"),
])
def test_conflicting_schedule_features_are_refused_naming_both(flags, named):
    args = argparse.Namespace(flow_schedule_config=None, **flags)
    with pytest.raises(adapter.ScheduleConflict) as failure:
        adapter.validate_args_wrapper(lambda a, d=None: a, None, (args, {}), {})
    assert "mindspeed-flow schedule (--flow-schedule)" in str(failure.value) and named in str(failure.value)


def test_the_conflicts_are_upstreams_real_arguments():
    """Each refused flag is declared by the pinned MindSpeed / MindSpeed-MM sources under
    the name the check reads (argparse's dest of the flag)."""
    from pinned_upstream import upstream_sources

    sources = upstream_sources()
    declared = ""
    for tree in (sources.mindspeed / "mindspeed", sources.mindspeed_mm / "mindspeed_mm"):
        for path in sorted(tree.rglob("*.py")):
            text = path.read_text(errors="replace")
            if "add_argument" in text or "layerwise_disaggregated_training" in text:
                declared += text
    for flag in ("--schedules-method", "--recompute-in-bubble", "--recompute-in-advance", "--hetero-parallel",
                 "--variable-seq-lengths", "--optimize-send-recv-comm", "--use-multiparameter-pipeline-model-parallel",
                 "--dist-train", "--moe-fb-overlap"):
        assert f"'{flag}'" in declared or f'"{flag}"' in declared, flag
    assert "args.layerwise_disaggregated_training = " in declared
    assert "choices=['dualpipev']" in declared


def test_no_moe_fb_overlap_refusal_when_it_keeps_megatrons_schedule():
    args = argparse.Namespace(flow_schedule_config=None, moe_fb_overlap=True, pipeline_model_parallel_size=2)
    adapter.check_conflicts(args)  # MindSpeed registers no schedule of its own here


def test_variable_seq_lengths_composes_and_says_why(caplog):
    """MindSpeed's --variable-seq-lengths patches p2p _communicate, which our runtime never
    calls (every transfer carries its shape): start-up goes on and logs that once; a real
    conflict next to it is still refused."""
    args = argparse.Namespace(flow_schedule_config=None, variable_seq_lengths=True, pipeline_model_parallel_size=2)
    with caplog.at_level(logging.WARNING, logger="mindspeed_flow.schedule"):
        assert adapter.validate_args_wrapper(lambda a, d=None: a, None, (args, {}), {}) is args
    bypassed = [r.getMessage() for r in caplog.records if "--variable-seq-lengths" in r.getMessage()]
    assert len(bypassed) == 1 and "bypassed" in bypassed[0]
    args.hetero_parallel = True
    with pytest.raises(adapter.ScheduleConflict, match="MindSpeed-MM --hetero-parallel"):
        adapter.validate_args_wrapper(lambda a, d=None: a, None, (args, {}), {})


def test_at_one_stage_without_a_layout_the_log_says_megatrons_function_runs(caplog, tmp_path):
    """(issue 19, defect 6) At PP=1 with no --flow-schedule-config Megatron's own
    forward_backward_no_pipelining runs: the log says so, and claims no bypass of
    --variable-seq-lengths; with a one-stage layout our runtime runs and the bypass is true."""
    args = argparse.Namespace(flow_schedule_config=None, variable_seq_lengths=True, pipeline_model_parallel_size=1)
    with caplog.at_level(logging.INFO, logger="mindspeed_flow.schedule"):
        adapter.validate_args_wrapper(lambda a, d=None: a, None, (args, {}), {})
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if "bypassed" in m]
    assert any("Megatron's own forward_backward_no_pipelining runs each step, not the plugin's runtime" in m
               for m in messages)
    caplog.clear()
    layout = tmp_path / "one_stage.yaml"
    layout.write_text("regions:\n  - {name: llm, layers: 2}\n")
    args.flow_schedule_config = str(layout)
    try:
        with caplog.at_level(logging.INFO, logger="mindspeed_flow.schedule"):
            adapter.validate_args_wrapper(lambda a, d=None: a, None, (args, {}), {})
    finally:
        adapter.configure()
    messages = [r.getMessage() for r in caplog.records]
    assert len([m for m in messages if "bypassed" in m]) == 1
    assert not [m for m in messages if "no_pipelining" in m]


def test_runtime_section_sets_the_fault_timeout_and_send_bound(tmp_path):
    config = tmp_path / "layout.yaml"
    config.write_text("regions:\n  - {name: llm, layers: 4}\nruntime: {timeout_s: 7.5, max_pending_sends: 3}\n")
    args = argparse.Namespace(flow_schedule_config=str(config), pipeline_model_parallel_size=2)
    try:
        adapter.validate_args_wrapper(lambda a, d=None: a, None, (args, {}), {})
        options = adapter.SETTINGS.options
        assert (options.wait.timeout_s, options.wait.abort_poll_s, options.max_pending_sends) == (7.5, 0.25, 3)
        config.write_text("regions:\n  - {name: llm, layers: 4}\nruntime: {timeout: 7.5}\n")
        with pytest.raises(ValueError, match=rf"{config}: unknown key runtime\.timeout \(known in runtime: timeout_s, abort_poll_s, max_pending_sends\)"):
            adapter.validate_args_wrapper(lambda a, d=None: a, None, (args, {}), {})
    finally:
        adapter.configure()


def test_start_up_loads_the_layout_and_fails_on_a_bad_file(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("regions:\n  - {name: llm, layers: 4}\n")
    args = argparse.Namespace(flow_schedule_config=str(good), pipeline_model_parallel_size=2)
    try:
        adapter.validate_args_wrapper(lambda a, d=None: a, None, (args, {}), {})
        (llm,) = adapter.SETTINGS.layout(2, 1)
        assert llm.skeleton == OneFOneB(stages=2)
        bad = tmp_path / "bad.yaml"
        bad.write_text("regions:\n  - {name: llm, layers: 4, skeleton: nope}\n")
        with pytest.raises(ScheduleError, match=str(bad)):
            adapter.validate_args_wrapper(lambda a, d=None: a, None,
                                          (argparse.Namespace(flow_schedule_config=str(bad)), {}), {})
    finally:
        adapter.configure()


# --------------------------------------------------------------------------- the decoupled form


def test_decoupled_form_gives_a_decoupled_layout(tmp_path):
    from mindspeed_flow.decoupled import DecoupledLayout
    from mindspeed_flow.runtime.layout import load_decoupled

    path = tmp_path / "decoupled.yaml"
    path.write_text("decoupled: {encoder: {dp: 1, tp: 1}, backbone: {dp: 1, tp: 1, pp: 2}, max_in_flight: 2}\n")
    assert load_decoupled(path) == DecoupledLayout(encoder_dp=1, backbone_pp=2, max_ahead=2)
    path.write_text("decoupled:\n  encoder: {dp: 4, tp: 2}\n  backbone: {dp: 2, tp: 2, pp: 2}\n"
                    "  max_in_flight: null\n")
    layout = load_decoupled(path)  # encoder.dp counts the job's replicas: 2 per backbone replica
    assert layout == DecoupledLayout(encoder_dp=2, encoder_tp=2, backbone_pp=2, backbone_tp=2, backbone_dp=2,
                                     max_ahead=None)
    assert layout.world_size == 16
    path.write_text("decoupled: {encoder: {}, backbone: {pp: 3}}\n")  # sizes default to 1, max_in_flight to 2
    assert load_decoupled(path) == DecoupledLayout(encoder_dp=1, backbone_pp=3)
    regions = tmp_path / "regions.yaml"
    regions.write_text("regions:\n  - {name: llm, layers: 4}\n")
    assert load_decoupled(regions) is None


@pytest.mark.parametrize("text, message", [
    ("decoupled: {encoder: {dp: 1}, backbone: {pp: 2}, max_in_flite: 2}",
     "unknown key decoupled.max_in_flite (known in decoupled: encoder, backbone, max_in_flight, flow, "
     "flow_encoder_batch_patches, flow_encoder_cost, flow_max_in_flight, flow_repack)"),
    ("decoupled: {encoder: {dp: 1, pp: 2}, backbone: {pp: 2}}", "unknown key decoupled.encoder.pp"),
    ("decoupled: {backbone: {pp: 2}}", "missing key decoupled.encoder"),
    ("decoupled: {encoder: {dp: 1}, backbone: {dp: 1}}", "missing key decoupled.backbone.pp"),
    ("decoupled: {encoder: {dp: two}, backbone: {pp: 2}}", "decoupled.encoder.dp: expected int, got str 'two'"),
    ("decoupled: {encoder: {dp: 1}, backbone: {pp: 2, tp: true}}", "decoupled.backbone.tp: expected int, got bool"),
    ("decoupled: {encoder: {dp: 0}, backbone: {pp: 2}}", "decoupled.encoder: dp must be >= 1, got 0"),
    ("decoupled: {encoder: {dp: 1}, backbone: {pp: 0}}", "decoupled.backbone: pp must be >= 1, got 0"),
    ("decoupled: {encoder: {dp: 1}, backbone: {pp: 2}, max_in_flight: 0}",
     "decoupled: max_in_flight must be >= 1 or null"),
    ("decoupled: {encoder: {dp: 1}, backbone: {pp: 2}, flow: true, flow_max_in_flight: 0}",
     "decoupled: flow_max_in_flight must be >= 1 or null"),
    ("decoupled: {encoder: {dp: 3}, backbone: {pp: 1, dp: 2}}",
     "decoupled: encoder.dp 3 (encoder replicas in the job) does not split over backbone.dp 2"),
    ("decoupled: [1, 2]", "decoupled: expected a mapping"),
    ("decoupled: {encoder: {dp: 1}, backbone: {pp: 2}}\nregions: []",
     "a layout file holds one of regions:, vlm:, decoupled:; this one has regions: and decoupled:"),
], ids=["unknown-key", "unknown-nested-key", "missing-encoder", "missing-pp", "wrong-type", "bool-is-not-int",
        "encoder-dp-0", "pp-0", "in-flight-0", "flow-in-flight-0", "encoder-split", "not-a-mapping", "two-forms"])
def test_a_bad_decoupled_form_names_the_file_and_the_field(tmp_path, text, message):
    from mindspeed_flow.runtime.layout import load_decoupled

    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ScheduleError) as refused:
        load_decoupled(path)
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value)


def test_a_decoupled_file_is_not_regions_of_one_pipeline(tmp_path):
    """The schedule adapter reads a non-``vlm:`` file as regions at start-up: a decoupled one
    is refused there with the reason, never run as a pipeline."""
    path = tmp_path / "decoupled.yaml"
    path.write_text("decoupled: {encoder: {dp: 1}, backbone: {pp: 2}}\n")
    with pytest.raises(ScheduleError, match=r"decoupled: a decoupled layout .* is a step of its own, not regions"):
        load_layout(path, 2)
