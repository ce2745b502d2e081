"""The plugin's switches in the real job (issue 19, defects 2, 4 and 6): MindSpeed-MM's own
``pretrain_vlm.py`` under torchrun (``realjob.py``), flags as a user adds them.

- 2: packing never silently changes the attention.  ``--flow-packing`` alone brings the
  varlen attention (``fused_attn``) with it and says so; no LLM attention call of a packed
  run lets a sample see another sample of its pack, on both of MindSpeed's attention paths
  (``--use-flash-attn``: the fused kernel; without: Megatron's core attention with a dense
  mask).  ``--no-flow-fused-attn`` next to packing (``--flow-packing`` or
  ``--use-flowtrain``) is refused before anything runs, naming both flags.
- 4: a decoupled allocator plan (``mindspeed-flow plan`` on ``configs/allocator/``, the
  encoder on devices of its own) is refused with the reason at the plan's device count and
  at the backbone's world size, where it used to be applied as co-located without a word.
- 6: the log says what the plugin did in this job: at PP=1 without a layout Megatron's own
  ``forward_backward_no_pipelining`` runs (no claim that our runtime bypasses
  ``--variable-seq-lengths``); ``pool`` and ``system`` say what they did, never "no patches".
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from realjob import RealJob
from test_real_job import JOBS  # the runs test_real_job.py makes, shared by name within a session

from mindspeed_flow.allocator import AllocationPlan

pytestmark = pytest.mark.timeout(1500)  # a test may start two real jobs on a loaded machine

ROOT = Path(__file__).resolve().parents[2]
PACKING_ALONE = JOBS["pack_pp1"]
assert PACKING_ALONE.plugin == ("--flow-packing",)


@dataclass(frozen=True)
class DefaultAttentionJob(RealJob):
    """The same job without ``--use-flash-attn``: MindSpeed's default attention path
    (Megatron's core attention with the dense mask MindSpeed-MM builds)."""

    def args(self, *args, **kwargs) -> list[str]:
        return [a for a in super().args(*args, **kwargs) if a != "--use-flash-attn"]


def llm_calls(run) -> list[dict]:
    calls = [c for c in run.attention if c["training"]]
    assert calls, "no LLM attention call was observed"
    return calls


def assert_no_call_crosses_a_sample_boundary(run) -> None:
    calls = llm_calls(run)
    assert max(max(c["samples_in_row"], default=0) for c in calls) > 1, "no pack held two samples"
    crossing = [c for c in calls if c["crosses"]]
    assert not crossing, f"{len(crossing)} of {len(calls)} attention calls cross a sample boundary: {crossing[:2]}"
    assert all(c["packed"] for c in calls if max(c["samples_in_row"], default=0) > 1)


@pytest.mark.parametrize("name, job", [("pack_pp1", PACKING_ALONE),
                                       ("flag_packing_default_attn", DefaultAttentionJob(plugin=("--flow-packing",)))])
def test_packing_alone_brings_the_varlen_attention_and_no_sample_sees_another(real_jobs, name, job):
    """Defect 2: before, the packs reached the LLM's attention with one causal mask over the
    whole pack (cu_seqlens dropped in VLMModel.forward's **kwargs), without a word."""
    run = real_jobs.run(name, job)
    assert len(run.losses) == job.iters
    assert_no_call_crosses_a_sample_boundary(run)
    assert "fused_attn on with --flow-packing: packs need the varlen attention" in run.output


def test_flowtrain_packs_never_attend_across_samples(real_jobs):
    run = real_jobs.run("flow_pp1", JOBS["flow_pp1"])
    assert_no_call_crosses_a_sample_boundary(run)


def test_upstream_as_is_has_one_sample_per_row(real_jobs):
    """The reference the packed runs are held to: upstream's rows never hold two samples."""
    run = real_jobs.run("up_pp1", JOBS["up_pp1"])
    assert all(max(c["samples_in_row"], default=0) <= 1 and not c["crosses"] for c in llm_calls(run))


@pytest.mark.parametrize("flags, packing", [
    (("--flow-packing", "--no-flow-fused-attn"), "--flow-packing"),
    (("--use-flowtrain", "--no-flow-fused-attn"), "--flow-packing (on under --use-flowtrain)"),
])
@pytest.mark.parametrize("launch", ["pth", "module"])
def test_packing_with_the_varlen_attention_off_is_refused_naming_both_flags(real_jobs, flags, packing, launch):
    run = real_jobs.run(f"refused_{launch}_{flags[0].strip('-')}", RealJob(plugin=flags, launch=launch), check=False)
    assert run.returncode != 0 and not run.losses
    refusal = [line for line in run.output.splitlines() if "mindspeed-flow: refusing to start:" in line]
    assert refusal and f"--no-flow-fused-attn with {packing}:" in refusal[0], run.output[-3000:]
    assert "attend to the other samples of its pack" in refusal[0]


# --------------------------------------------------------------------------- defect 4

@pytest.fixture(scope="module")
def decoupled_plan(tmp_path_factory) -> tuple[Path, AllocationPlan]:
    """`mindspeed-flow plan configs/allocator/tiny_cpu.yaml --devices 3`: the encoder on 1
    device of its own, the backbone dp 2 (the tiny CPU profile's best plan on 3 devices)."""
    out = tmp_path_factory.mktemp("plan") / "plan.yaml"
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "plan", str(ROOT / "configs/allocator/tiny_cpu.yaml"),
                           "--devices", "3", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plan = AllocationPlan.load(out)
    assert plan.placement == "decoupled" and (plan.encoder.devices, plan.backbone.devices) == (1, 2)
    return out, plan


@pytest.mark.parametrize("where", ["plan_devices", "backbone_devices"])
def test_a_decoupled_plan_is_refused_with_the_reason(real_jobs, decoupled_plan, where):
    """At the backbone's world size the old patch applied the plan's backbone sizes as if the
    encoder sat in stage 0 (the job trained, the log said only "mindspeed-flow: allocator")."""
    path, plan = decoupled_plan
    world = plan.devices if where == "plan_devices" else plan.backbone.devices
    vision_layers = plan.encoder.layers  # the model the plan was made for: its layer counts
    job = RealJob(dp=world, gbs=plan.global_batch, iters=2, text_layers=sum(plan.backbone.layer_split),
                  plugin=("--flow-allocator", "--flow-allocator-plan", str(path)),
                  model_patch=(("image_encoder.vision_encoder.num_layers", vision_layers),
                               ("image_encoder.vision_encoder.pipeline_num_layers", [vision_layers])))
    run = real_jobs.run(f"allocator_decoupled_{where}", job, check=False)
    assert run.returncode != 0 and not run.losses, run.output[-3000:]
    assert (f"refusing a decoupled plan: its encoder runs on {plan.encoder.devices} devices of its own"
            in run.output), run.output[-3000:]
    assert f"this job: world size {world}" in run.output and "placements: [colocated]" in run.output


# --------------------------------------------------------------------------- defect 6

def test_the_log_says_what_the_plugin_did_at_pp1(real_jobs):
    run = real_jobs.run("flow_pp1", JOBS["flow_pp1"])
    assert "no patches in this version" not in run.output
    # Megatron's own no-pipelining function runs at PP=1 without a layout: no bypass claim
    assert "one pipeline stage and no --flow-schedule-config: Megatron's own forward_backward_no_pipelining" \
        in run.output
    assert "bypassed" not in run.output
    assert "mindspeed-flow pool: no pool opened (backend shm unused)" in run.output
    system = [line for line in run.output.splitlines() if "mindspeed-flow system: bound local rank 0: cores " in line]
    assert system, run.output[-3000:]
    # torchrun's own process set the defaults (the flags are on its command line too): not the user
    assert "kept user value" not in system[0] and "(set by the plugin in the launching process)" in system[0]


def test_both_attention_paths_train_the_same_packs_alike(real_jobs):
    """With and without --use-flash-attn, the packs go through the same varlen attention (the
    default path's mask generator leaves packed calls alone: it used to fail building a
    dense mask from MindSpeed-MM's model config): same samples fed, same losses."""
    flash = real_jobs.run("pack_pp1", PACKING_ALONE)
    default = real_jobs.run("flag_packing_default_attn", DefaultAttentionJob(plugin=("--flow-packing",)))
    assert flash.fed == default.fed
    for step, loss in flash.losses.items():
        assert default.losses[step] == pytest.approx(loss, rel=1e-3), step
