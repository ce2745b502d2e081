"""The plugin's ``conv_matmul`` and ``recipes`` in the Qwen3-VL real job: MindSpeed-MM's own
``pretrain_transformers.py CONFIG.yaml`` (pinned, unmodified) under torchrun on CPU, through the
``realjob_transformers.py`` harness (tiny random Qwen3-VL in HF format, the recipe's YAML with a
CPU run's changes).  Here the ViT and its mergers train (the recipe freezes them: ``freeze:
false`` for both), and the run saves its model at the last iteration.  ``--no-flow-packing``
keeps MindSpeed-MM's own data path, so each run feeds upstream's samples.

What is asserted:

- ``--use-flowtrain`` (DDP, one rank): ``conv_matmul`` acts (the feature log names it; the HF
  ViT's ``Qwen3VLVisionPatchEmbed.proj`` is the matmul), the run feeds upstream's samples, its
  losses equal upstream's within bf16 noise (the matmul sums in another order), and the saved
  model has upstream's keys and shapes (the patch embedding keeps the conv's ``[E, 3, 2, 16, 16]``);
- ``--flow-module-lr model.model.visual=0 --flow-module-grad-clip model.model.language_model=MAX``
  through this path's optimizer (Megatron's, built by ``setup_model_and_optimizer`` over
  ``TransformersModel``): the job logs the ViT's param group (x0, with its tensors), every
  iteration clips the language model's gradient (logged norm above MAX), the saved ViT weights
  are the HF directory's bit for bit while the language model's moved, and the first iteration's
  loss (before any update) is the plain ``--use-flowtrain`` run's, the later ones differ;
- the same with FSDP2 on 2 gloo ranks (``DTensor`` parameters; the clip's norm summed over the
  shards): logged groups and clips, every iteration, finite losses, and the first iteration's
  language-model norm (same samples, same model) is the DDP run's within 2% (FSDP2 computes in
  bf16; measured 1.263 against 1.264).  Before the sums were fp32 on the gradients' device, the
  float64 sums did not reduce over FSDP2's mesh group and the norm was rank 0's shard alone (1.05).
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from realjob_run import RealRun
from realjob_transformers import TransformersJob
from test_real_job import BF16_RTOL, ITERS, assert_finished
from test_real_job_ckpt import _PICKLE

TRAIN_VIT = (("model.image_encoder.vision_encoder.freeze", False),
             ("model.image_encoder.vision_projector.freeze", False))
SAVE = (("gpt_args.save", "ckpt"), ("gpt_args.save_interval", ITERS))
FLOW = ("--use-flowtrain", "--no-flow-packing")
VIT, LLM = "model.model.visual", "model.model.language_model"
MAX_NORM = 1e-3
RECIPE = ("--flow-module-lr", f"{VIT}=0", "--flow-module-grad-clip", f"{LLM}={MAX_NORM:g}")
PATCH_EMBED = "model.model.visual.patch_embed.proj.weight"
FSDP2 = {"dp": 2, "fsdp2": True, "ckpt_format": "torch_dcp"}
JOBS = {
    "q3p_up": TransformersJob(iters=ITERS, yaml_patch=TRAIN_VIT + SAVE),
    "q3p_flow": TransformersJob(iters=ITERS, yaml_patch=TRAIN_VIT + SAVE, plugin=FLOW),
    "q3p_recipes": TransformersJob(iters=ITERS, yaml_patch=TRAIN_VIT + SAVE, plugin=FLOW + RECIPE),
    "q3p_recipes_fsdp2": TransformersJob(iters=ITERS, yaml_patch=TRAIN_VIT, plugin=FLOW + RECIPE, **FSDP2),
}
GROUPS_LINE = re.compile(r"mindspeed-flow recipes: optimizer param groups by module: (.*)")
CLIPPED_LINE = re.compile(r"mindspeed-flow recipes: clipped module gradients \(norm before > max\): (\S+) (\S+) > ")


def run(real_jobs, name: str) -> RealRun:
    return real_jobs.run(name, JOBS[name])


def saved_model(run_: RealRun) -> dict[str, torch.Tensor]:
    """The model state dict of the run's last checkpoint (``ckpt_format: torch``)."""
    path = run_.workdir / "ckpt" / f"iter_{ITERS:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)["model"]


def hf_weights(run_: RealRun) -> dict[str, torch.Tensor]:
    """The HF directory the run started from, keyed as ``TransformersModel`` names them."""
    from safetensors.torch import load_file

    weights = load_file(str(run_.workdir.parent / run_.job.assets_name / "qwen3vl_hf" / "model.safetensors"))
    return {f"model.{key}": value for key, value in weights.items()}


def feature_line(run_: RealRun) -> str:
    lines = [line for line in run_.output.splitlines() if "=> mindspeed-flow: " in line and "; " in line]
    assert len(lines) == 1, run_.output[-3000:]
    return lines[0].split("=> mindspeed-flow: ", 1)[1]


def clipped(run_: RealRun) -> list[tuple[str, float]]:
    return [(m.group(1), float(m.group(2))) for m in CLIPPED_LINE.finditer(run_.output)]


def test_conv_matmul_acts_on_the_hf_vit_within_bf16_of_upstream(real_jobs):
    ours, upstream = run(real_jobs, "q3p_flow"), run(real_jobs, "q3p_up")
    assert_finished(ours)
    assert "conv_matmul" in feature_line(ours).split(";")[0].split(", ")
    assert ours.fed == upstream.fed
    for i, loss in upstream.exact_losses.items():
        assert math.isclose(ours.exact_losses[i], loss, rel_tol=BF16_RTOL), (i, ours.exact_losses, upstream.exact_losses)
    mine, theirs = saved_model(ours), saved_model(upstream)
    assert mine.keys() == theirs.keys() and PATCH_EMBED in theirs
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in theirs.items()}
    assert theirs[PATCH_EMBED].shape[1:] == (3, 2, 16, 16)
    # the ViT trained in both runs (what makes the recipe run's unchanged ViT mean something)
    assert not torch.equal(theirs[PATCH_EMBED], hf_weights(upstream)[PATCH_EMBED])


def test_module_lr_and_clip_act_through_this_paths_optimizer(real_jobs):
    ours, plain = run(real_jobs, "q3p_recipes"), run(real_jobs, "q3p_flow")
    assert_finished(ours)
    groups = GROUPS_LINE.search(ours.output)
    assert groups, ours.output[-3000:]
    vit_tensors = int(re.search(rf"{re.escape(VIT)} x0 \((\d+) tensors\)", groups.group(1)).group(1))
    saved, initial = saved_model(ours), hf_weights(ours)
    vit_keys = [k for k in saved if k.startswith(VIT + ".")]
    assert vit_tensors == len(vit_keys) > 10
    for key in vit_keys:  # learning rate 0: the ViT is where it started, bit for bit
        assert torch.equal(saved[key], initial[key]), key
    llm_keys = [k for k in saved if k.startswith(LLM + ".")]
    assert llm_keys and any(not torch.equal(saved[k], initial[k]) for k in llm_keys)
    # every iteration's language-model gradient was above MAX_NORM and clipped to it
    clips = clipped(ours)
    assert len(clips) == ITERS and all(module == LLM and norm > MAX_NORM for module, norm in clips), clips
    assert ours.fed == plain.fed
    assert ours.exact_losses[1] == plain.exact_losses[1]  # the same model before the first update
    # the schedule's first step has LR 0 (warm-up): the runs part from iteration 3
    assert all(ours.exact_losses[i] != plain.exact_losses[i] for i in range(3, ITERS + 1))


def test_module_lr_and_clip_act_under_fsdp2(real_jobs):
    ours, ddp = run(real_jobs, "q3p_recipes_fsdp2"), run(real_jobs, "q3p_recipes")
    assert_finished(ours)
    assert {dp for _, dp, _ in ours.fed} == {0, 1}
    groups = GROUPS_LINE.search(ours.output)
    assert groups and int(re.search(rf"{re.escape(VIT)} x0 \((\d+) tensors\)", groups.group(1)).group(1)) > 10
    clips = clipped(ours)
    assert len(clips) == ITERS and all(module == LLM and norm > MAX_NORM for module, norm in clips), clips
    assert math.isclose(clips[0][1], clipped(ddp)[0][1], rel_tol=0.02), (clips, clipped(ddp))
