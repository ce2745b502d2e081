"""The ``allocator`` patch: a plan's sizes reach Megatron's args (through Megatron-LM's real
``parse_args`` / ``validate_args`` from the pinned sources) and MindSpeed-MM's model config;
a plan that does not fit the job is refused with both numbers named."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mindspeed_flow.adapters.megatron.allocator_plan import apply_to_megatron_args, apply_to_mm_model
from mindspeed_flow.allocator import AllocationPlan, AllocatorError, BackboneConfig, EncoderConfig, Prediction
from mindspeed_flow.allocator.upstream import megatron_args, mindspeed_mm_args
from mindspeed_flow.config import ENV_VAR, add_flow_arguments
from cli_plans import cli_plan
from pinned_upstream import upstream_sources
from subprocess_utils import last_json, run_python

PREDICTION = Prediction(throughput=10.0, production=11.0, consumption=10.0, mfu=0.4, bubble_fraction=0.1,
                        backbone_step_s=6.4, microbatches=16, encoder_memory_gib=10.0, backbone_memory_gib=50.0)


def make_plan(split=(10,) * 8, dp=2, tp=4, micro_batch=1) -> AllocationPlan:
    """A co-located plan (the encoder in stage 0 with the backbone's TP and DP): the only
    placement a Megatron / MindSpeed-MM job applies."""
    return AllocationPlan(EncoderConfig(dp=dp, tp=tp, layers=32),
                BackboneConfig(dp=dp, tp=tp, pp=len(split), micro_batch=micro_batch, layer_split=split),
                global_batch=64, predicted=PREDICTION, placement="colocated")


@pytest.mark.parametrize("config, devices", [("tiny_cpu.yaml", 3), ("vlm_72b.yaml", 512)])
def test_a_decoupled_plan_is_refused_with_the_reason_at_any_world_size(tmp_path_factory, config, devices):
    """(issue 19, defect 4) A plan whose encoder has devices of its own is refused, with the
    reason, at the plan's device count and at the backbone's world size (where it used to be
    applied as if co-located, without a word); the CLI's text says so too."""
    path, plan, text = cli_plan(config, devices, tmp_path_factory)
    assert plan.placement == "decoupled" and plan.encoder.devices > 0
    layers = sum(plan.backbone.layer_split)
    for world in (plan.devices, plan.backbone.devices):
        args = namespace(path, world_size=world, num_layers=layers, tensor_model_parallel_size=1)
        with pytest.raises(AllocatorError) as refused:
            apply_to_megatron_args(args)
        message = str(refused.value)
        assert f"refusing a decoupled plan: its encoder runs on {plan.encoder.devices} devices of its own" in message
        assert f"this job: world size {world}" in message and "mindspeed-flow train" in message
        assert "the plugin's `pool` feature (--flow-pool or --use-flowtrain), which is not on" in message
        assert "placements: [colocated]" in message
        assert args.tensor_model_parallel_size == 1  # nothing was written
    model = _config_tree({"image_encoder": {"vision_encoder": {"num_layers": plan.encoder.layers}},
                          "text_decoder": {}})
    with pytest.raises(AllocatorError, match="refusing a decoupled plan"):
        apply_to_mm_model(model, plan, "plan.yaml")
    assert not hasattr(model.text_decoder, "pipeline_num_layers")
    # the CLI says how such a plan runs, or that none does (its encoder does not split)
    if plan.encoder.dp % plan.backbone.dp:
        assert "no decoupled layout runs this plan" in text and "or apply it at start-up" not in text
    else:
        assert f"or apply it at start-up, on {plan.devices} ranks, with the plugin's pool feature" in text


def test_the_refusal_names_the_plans_best_colocated_alternative(tmp_path_factory):
    path, plan, _ = cli_plan("vlm_72b.yaml", 512, tmp_path_factory)
    alternative = next(a for a in plan.alternatives if a.placement == "colocated").backbone
    with pytest.raises(AllocatorError, match=(
            rf"best co-located alternative: backbone dp {alternative.dp} x tp {alternative.tp} x pp {alternative.pp}, "
            rf"micro batch {alternative.micro_batch}, {alternative.devices} devices")):
        apply_to_megatron_args(namespace(path, world_size=plan.backbone.devices))


def test_a_colocated_plan_from_the_cli_is_applied(tmp_path_factory):
    path, plan, text = cli_plan("tiny_cpu.yaml", 8, tmp_path_factory)
    assert plan.placement == "colocated" and "or apply it at start-up" in text
    args = namespace(path, world_size=plan.devices, num_layers=sum(plan.backbone.layer_split))
    apply_to_megatron_args(args)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.global_batch_size) == (
        plan.backbone.tp, plan.backbone.pp, plan.global_batch)


@pytest.fixture(scope="module")
def upstream() -> dict[str, str]:
    return upstream_sources().env()


def namespace(plan_file: Path, **values) -> argparse.Namespace:
    return argparse.Namespace(flow_allocator_plan=str(plan_file), **values)


def test_plan_sizes_go_into_args(tmp_path):
    path = make_plan().save(tmp_path / "plan.yaml")
    args = namespace(path, world_size=64, num_layers=80, tensor_model_parallel_size=1,
                     pipeline_model_parallel_size=1, micro_batch_size=4, global_batch_size=None)
    apply_to_megatron_args(args)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.micro_batch_size,
            args.global_batch_size, args.sequence_parallel) == (4, 8, 1, 64, True)
    assert not hasattr(args, "decoder_first_pipeline_num_layers")  # even split: nothing to say


def test_uneven_first_and_last_stage_use_megatrons_flags(tmp_path):
    path = make_plan(split=(8, 11, 11, 11, 11, 11, 11, 6)).save(tmp_path / "plan.json")
    args = namespace(path, world_size=64, num_layers=80)
    apply_to_megatron_args(args)
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (8, 6)
    bad = make_plan(split=(10, 9, 11, 10, 10, 10, 10, 10)).save(tmp_path / "bad.yaml")
    with pytest.raises(AllocatorError, match=r"cannot express the layer split \[10, 9, 11"):
        apply_to_megatron_args(namespace(bad, world_size=64, num_layers=80))


def test_colocated_plan_is_upstreams_own_layout(tmp_path):
    """Encoder in stage 0 with the backbone's TP: no --hetero-parallel, the LLM split holds
    fewer layers on stage 0 (Megatron's first-stage flag), the ViT sits on stage 0."""
    plan = AllocationPlan(EncoderConfig(dp=2, tp=4, layers=32),
                BackboneConfig(dp=2, tp=4, pp=8, micro_batch=1, layer_split=(3, 11, 11, 11, 11, 11, 11, 11)),
                global_batch=64, predicted=PREDICTION, placement="colocated")
    assert plan.devices == 64 and "--hetero-parallel" not in mindspeed_mm_args(plan)
    args = namespace(plan.save(tmp_path / "plan.yaml"), world_size=64, num_layers=80)
    apply_to_megatron_args(args)
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (3, 11)
    # The printed flags say the same split as the patch applies.
    printed = " ".join(megatron_args(plan))
    assert "--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 11" in printed
    assert "--decoder-first" not in " ".join(megatron_args(make_plan()))  # even split: Megatron's default
    model = _config_tree({"image_encoder": {"vision_encoder": {"num_layers": 32}}, "text_decoder": {}})
    apply_to_mm_model(model, AllocationPlan.load(tmp_path / "plan.yaml"), "plan.yaml")
    assert model.text_decoder.pipeline_num_layers == [3, 11, 11, 11, 11, 11, 11, 11]
    assert model.image_encoder.vision_encoder.pipeline_num_layers == [32, 0, 0, 0, 0, 0, 0, 0]


def test_a_plan_that_does_not_fit_the_job_is_refused_by_name(tmp_path):
    path = make_plan().save(tmp_path / "plan.yaml")
    with pytest.raises(AllocatorError, match=r"needs 64 devices \(dp 2 x tp 4 x pp 8\) but this job has world size 70"):
        apply_to_megatron_args(namespace(path, world_size=70, num_layers=80))
    with pytest.raises(AllocatorError, match=r"splits 80 backbone layers .* but --num-layers is 48"):
        apply_to_megatron_args(namespace(path, world_size=64, num_layers=48))
    with pytest.raises(AllocatorError, match="no plan was given: add --flow-allocator-plan"):
        apply_to_megatron_args(argparse.Namespace(world_size=64))
    with pytest.raises(AllocatorError, match="does not exist"):
        apply_to_megatron_args(namespace(tmp_path / "missing.yaml"))


def _config_tree(value):
    """A stand-in for MindSpeed-MM's ``ConfigReader`` (attribute access over the JSON): the
    real class sits in a module whose package import needs torch_npu."""
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _config_tree(v) for k, v in value.items()})
    return value


def test_mindspeed_mm_model_config_gets_the_per_module_splits(upstream, tmp_path):
    model_json = Path(upstream["MINDSPEED_MM_SRC"], "examples/qwen2.5vl/model_72b.json")
    model = _config_tree(json.loads(model_json.read_text()))
    assert model.text_decoder.pipeline_num_layers == [6, 11, 11, 11, 11, 11, 11, 8]  # upstream's own split
    plan = make_plan(split=(20, 20, 20, 20), dp=4)
    apply_to_mm_model(model, plan, "plan.yaml")
    assert model.text_decoder.pipeline_num_layers == [20, 20, 20, 20]
    assert model.image_encoder.vision_encoder.pipeline_num_layers == [32, 0, 0, 0]
    assert model.image_encoder.vision_encoder.tensor_model_parallel_size == 4  # co-located: the backbone's
    model.image_encoder.vision_encoder.num_layers = 24
    with pytest.raises(AllocatorError, match="plan's encoder has 32 layers, the vision encoder config has 24"):
        apply_to_mm_model(model, plan, "plan.yaml")


def test_real_megatron_lm_validate_args_derives_the_plans_data_parallel_size(upstream, tmp_path):
    """Megatron-LM core_v0.12.1's own parse_args + validate_args, plugin active from the
    command line: the plan's sizes are what Megatron validates, and the data parallel
    size Megatron derives from them is the plan's."""
    path = make_plan().save(tmp_path / "plan.yaml")
    flags = ["--flow-allocator", "--flow-allocator-plan", str(path)]
    code = '''
    import json, sys
    from megatron.training import arguments
    sys.argv = ["pretrain_gpt.py", "--num-layers", "80", "--hidden-size", "256", "--num-attention-heads", "8",
                "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "4",
                *sys.argv[1:]]
    args = arguments.parse_args(None, False)
    arguments.validate_args(args, {})
    print(json.dumps({k: getattr(args, k) for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                      "micro_batch_size", "global_batch_size", "data_parallel_size", "sequence_parallel")}))
    '''
    # CUDA_DEVICE_MAX_CONNECTIONS=1 is what Megatron asks of every TP job's launch script.
    env = {"PYTHONPATH": upstream["MEGATRON_LM_SRC"], "WORLD_SIZE": "64", "RANK": "0",
           "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    out = last_json(run_python(code, flags, env=env))
    assert out == {"tensor_model_parallel_size": 4, "pipeline_model_parallel_size": 8, "micro_batch_size": 1,
                   "global_batch_size": 64, "data_parallel_size": 2, "sequence_parallel": True}
    refused = run_python(code, flags, env={**env, "WORLD_SIZE": "48"})
    assert refused.returncode != 0 and "this job has world size 48" in refused.stderr


def test_doctor_finds_the_allocator_targets_in_the_pinned_sources(upstream):
    rows = []
    for root in (upstream["MINDSPEED_MM_SRC"], upstream["MEGATRON_LM_SRC"]):
        proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "doctor", "--json", "--src", root],
                              capture_output=True, text=True, timeout=120)
        rows += [r for r in json.loads(proc.stdout) if r["feature"] == "allocator"]
    found = {(r["target"], r["status"]) for r in rows}
    assert ("megatron.training.arguments:validate_args", "found") in found
    assert ("mindspeed_mm.configs.config:merge_mm_args", "found") in found


def test_the_plan_named_in_the_environment_reaches_megatrons_args(tmp_path, monkeypatch):
    """``--flow-allocator-plan`` in ``MINDSPEED_FLOW_FLAGS``: Megatron's own parse of the
    command line has no plan; the config tree has it, and the command line's wins."""
    path = make_plan().save(tmp_path / "plan.yaml")
    parser = add_flow_arguments(argparse.ArgumentParser(allow_abbrev=False))
    monkeypatch.setenv(ENV_VAR, f"--flow-allocator --flow-allocator-plan {path}")
    args = parser.parse_args([])
    args.world_size, args.num_layers = 64, 80
    assert args.flow_allocator_plan is None
    apply_to_megatron_args(args)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (4, 8)
    other = make_plan(split=(20,) * 4, dp=4, tp=4).save(tmp_path / "other.yaml")
    args = parser.parse_args(["--flow-allocator-plan", str(other)])
    args.world_size, args.num_layers = 64, 80
    apply_to_megatron_args(args)
    assert (args.pipeline_model_parallel_size, args.global_batch_size) == (4, 64)
