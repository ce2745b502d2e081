"""The transposed ViT (``<transpose, 1f1b>``, ``vlm: {transpose: true}``) on MindSpeed-MM's
real Qwen2.5-VL (issue 22).

Two gloo stages under torchrun, the ViT's ``pipeline_num_layers`` ``[2, 0]`` and the LLM's
``[1, 1]`` as MindSpeed-MM splits them; with the layout every stage builds a ViT replica and
the runtime runs microbatch ``m``'s ViT on rank ``m % 2``.  Three samples, one per
microbatch, fp32, one step through ``forward_backward_func`` and Megatron's
``finalize_model_grads`` (``driver.py``), from the plain single-process run's initial weights.

Compared with upstream's co-located single-process step (``fp32_plain``): the loss, and every
gradient by global name, within ``test_vlm_equivalence``'s fp32 bounds.  Trainable ViT:
every stage's replica holds the replicas' summed gradients (the plan's ``REDUCE`` on DDP's
``main_grad``), each equal to upstream's ViT gradient.  Frozen ViT (``vision_encoder.freeze``
and ``vision_projector.freeze``): no ViT gradient anywhere, the LLM's equal upstream's
(a frozen ViT changes no LLM gradient: the forward is the same).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from harness import Job, run_upstream
from test_vlm_equivalence import FP32_GRAD_RTOL, FP32_LOSS_RTOL, gradient_errors

SCHEDULE_GETTER = "megatron.core.pipeline_parallel.schedules:get_forward_backward_func"


def is_vit(name: str) -> bool:
    """A ViT (encoder or projector) parameter, whatever wraps the model (DDP, Float16Module)."""
    return ".image_encoder." in f".{name}"

TRANSPOSE_LAYOUT = "vlm: {transpose: true}\n"


@dataclass(frozen=True)
class TransposedJob(Job):
    """``Job`` at PP=2, with the ViT (encoder and projector) frozen or trainable."""

    vit_frozen: bool = False

    def model_json(self) -> dict:
        model = super().model_json()
        for part in ("vision_encoder", "vision_projector"):
            model["image_encoder"][part]["freeze"] = self.vit_frozen
        return model


def _grads_by_rank(run) -> list[dict[str, torch.Tensor]]:
    return [torch.load(path, weights_only=True) for path in run.grads_files]


@pytest.fixture(scope="module")
def transposed(runs, tmp_path_factory):
    """The two transposed runs by name (``trainable`` / ``frozen``), each made on first use."""
    from conftest import FP32

    root = tmp_path_factory.mktemp("transposed_runs")
    layout = root / "transpose.yaml"
    layout.write_text(TRANSPOSE_LAYOUT)
    made: dict = {}

    def get(name: str):
        if name not in made:
            job = TransposedJob(samples=FP32.samples, precision="fp32", flash_attn=True, pp=2,
                                vit_frozen=name == "frozen")
            made[name] = run_upstream(job, root / name, plugin=True, load=runs.get("fp32_plain").initial_weights,
                                      extra_plugin_flags=("--use-flowtrain", "--flow-schedule-config", str(layout)))
        return made[name]

    return get


@pytest.mark.parametrize("name", ["trainable", "frozen"])
def test_every_stage_holds_a_vit_replica_and_runs_our_runtime(transposed, name):
    run = transposed(name)
    assert len(run.results) == 2
    for rank, result in enumerate(run.results):
        assert result["vit_replica"], rank
        assert result["forward_backward_func"] == "mindspeed_flow.adapters.megatron.schedule:flow_forward_backward"
        statuses = {t: s for f, t, s in result["patches"] if f == "schedule"}
        assert statuses["mindspeed_mm.models.vlm_model:VLMModel.__init__"] == "applied"
        assert statuses["megatron.training.training:get_model"] == "applied"
    # stage 1's replica is marked shared (Megatron's grad norm counts stage 0's copy only)
    assert run.results[0]["shared_params"] == []
    shared = run.results[1]["shared_params"]
    assert shared and all(is_vit(n) for n in shared)


def test_transposed_trainable_vit_equals_upstream_fp32(runs, transposed):
    plain, ours = runs.get("fp32_plain"), transposed("trainable")
    assert ours.result["tokens"] == plain.result["tokens"]
    assert ours.loss == pytest.approx(plain.loss, rel=FP32_LOSS_RTOL)
    stages = _grads_by_rank(ours)
    vit = {n for n in plain.grads if is_vit(n)}
    assert vit, "the reference has no ViT gradients"
    for rank, grads in enumerate(stages):
        replica = {n: g for n, g in grads.items() if is_vit(n)}
        assert set(replica) == vit, rank
        errors = gradient_errors({n: plain.grads[n] for n in vit}, replica)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= FP32_GRAD_RTOL, f"rank {rank} {worst}: {errors[worst]:.2e}"
    llm = {n: g for grads in stages for n, g in grads.items() if not is_vit(n)}
    errors = gradient_errors({n: g for n, g in plain.grads.items() if n not in vit}, llm)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= FP32_GRAD_RTOL, f"{worst}: {errors[worst]:.2e}"


def test_transposed_frozen_vit_equals_upstream_fp32(runs, transposed):
    plain, ours = runs.get("fp32_plain"), transposed("frozen")
    assert ours.result["tokens"] == plain.result["tokens"]
    assert ours.loss == pytest.approx(plain.loss, rel=FP32_LOSS_RTOL)
    stages = _grads_by_rank(ours)
    assert all(not is_vit(n) for grads in stages for n in grads), "a frozen ViT got gradients"
    merged = {n: g for grads in stages for n, g in grads.items()}
    reference = {n: g for n, g in plain.grads.items() if not is_vit(n)}
    errors = gradient_errors(reference, merged)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= FP32_GRAD_RTOL, f"{worst}: {errors[worst]:.2e}"


# ------------------------------------------------------------------ pretrain_vlm.py itself

LAYOUT_FILE = Path(__file__).resolve().parent / "transpose_layout.yaml"


def _real_transposed():
    from realjob import RealJob
    from test_real_job import FLOW

    return RealJob(pp=2, plugin=FLOW + ("--flow-schedule-config", str(LAYOUT_FILE)), timeout_s=600)


@pytest.mark.timeout(1200)
def test_pretrain_vlm_transposed_runs_on_the_colocated_curve(real_jobs):
    """``pretrain_vlm.py`` at PP=2 with ``--use-flowtrain`` and the transposed layout: 8
    iterations finish, fed the co-located run's samples in its order, on its curve (bf16: the
    replicas' gradients are summed in another order than one rank accumulates them, so the
    parameters may round apart by an ulp: BF16_RTOL per iteration)."""
    from test_real_job import BF16_RTOL, assert_finished
    from test_real_job_pipeline import PIPELINE_JOBS

    whole = real_jobs.run("transpose_pp2", _real_transposed())
    assert whole.returncode == 0, whole.output[-3000:]
    assert_finished(whole)
    colocated = real_jobs.run("flow_pp2", PIPELINE_JOBS["flow_pp2"])
    assert colocated.fed == whole.fed  # the same samples, in the same order
    for i, loss in colocated.exact_losses.items():
        assert whole.exact_losses[i] == pytest.approx(loss, rel=BF16_RTOL), i


@pytest.mark.timeout(1800)
def test_pretrain_vlm_transposed_resume_continues_bit_for_bit(real_jobs):
    """Save at K and exit, resume to ITERS (``--ckpt-format torch``): every stage's file holds
    its LLM stage and its ViT replica (``image_encoder.*`` on stage 1 too), with their
    optimizer state; the resumed run is the uninterrupted one bit for bit, every sample fed
    once, in order."""
    from dataclasses import replace

    from test_real_job import ITERS, K, assert_finished
    from test_real_job_ckpt import _PICKLE

    base = _real_transposed()
    first = real_jobs.run("transpose_pp2_save", replace(base, save="ckpt", save_interval=K, exit_interval=K))
    assert_finished(first, last=K)
    step = first.workdir / "ckpt" / f"iter_{K:07d}"
    for stage in ("mp_rank_00_000", "mp_rank_00_001"):
        state = torch.load(step / stage / "model_optim_rng.pt", map_location="cpu", weights_only=False,
                           pickle_module=_PICKLE)
        assert {k.split(".")[0] for k in state["model"]} == {"image_encoder", "text_decoder"}, stage
    second = real_jobs.run("transpose_pp2_resume", replace(base, load=str(first.workdir / "ckpt")))
    assert_finished(second, first=K + 1, last=ITERS)
    whole = real_jobs.run("transpose_pp2", base)
    assert {**first.exact_losses, **second.exact_losses} == whole.exact_losses
    assert {**first.consumed, **second.consumed} == whole.consumed
    assert first.fed + second.fed == whole.fed
