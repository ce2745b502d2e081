"""FlowTrain's decoupled layout inside MindSpeed-MM's real model (issue 22): encoder ranks of
their own build the Qwen2.5-VL ViT + projector, backbone ranks their LLM stage, each role
with Megatron's groups over its own ranks; one training step runs the slice's
``<Decoupled, 1F1B>`` plan through the runtime's executor, embeddings and their gradients
through the pool (``shm`` and ``torch`` backends).  Losses and every gradient (fp32 ``main_grad``, by global name)
equal upstream's co-located single-process step on the same samples, within
``test_vlm_equivalence``'s fp32 bounds; so does the gradient norm Megatron's optimizer
computes for ``--clip-grad`` on every rank (the whole model's, not each role's).
"""

from __future__ import annotations

import json
from dataclasses import replace
import re
import sys
import time
from pathlib import Path

import pytest
import torch

from harness import Job, _free_port, _run_in_own_group, run_upstream, sample_specs, upstream_env
from pinned_upstream import upstream_sources
from test_vlm_equivalence import FP32_GRAD_RTOL, FP32_LOSS_RTOL, gradient_errors

HERE = Path(__file__).resolve().parent
DRIVER = HERE / "decoupled_driver.py"
DECOUPLED_STEP = "mindspeed_flow.adapters.megatron.decoupled_step:decoupled_forward_backward"
SHM = Path("/dev/shm")


def start_decoupled(job: Job, layout: dict, workdir: Path, load: Path, backend: str,
                    die: dict | None = None, packs: list | None = None) -> tuple[int, str, int]:
    """``decoupled_driver.py`` under torchrun on ``layout``'s world, with the plugin and
    ``--flow-pool-backend backend``: its return code, output and world size.  ``packs``: the
    slice's microbatches as packs of these samples (indices: one backbone replica; a list of
    them per slice: several), as the packing loader hands them, instead of one sample a
    microbatch."""
    workdir.mkdir(parents=True, exist_ok=True)
    model_json = workdir / "model.json"
    model_json.write_text(json.dumps(job.model_json(), indent=1))
    world = layout["backbone_dp"] * (layout["encoder_dp"] + layout["backbone_pp"])
    spec = {"samples": job.samples, "layout": job.layout, "decoupled": layout,
            "result": str(workdir / "result_{rank}.json"), "grads": str(workdir / "grads_{rank}.pt"),
            "captures": str(workdir / "captures_{rank}.pt"), "capture": [], "load": str(load), "save": None,
            "die": die, "packs": packs}
    (workdir / "job.json").write_text(json.dumps(spec))
    env = upstream_env(upstream_sources(), workdir)
    env["MINDSPEED_FLOW_HARNESS_JOB"] = str(workdir / "job.json")
    env["PYTHONPATH"] = f"{HERE}:{env['PYTHONPATH']}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
               "-m", "mindspeed_flow.launch", str(DRIVER), *job.megatron_args(model_json), "--use-flowtrain",
               "--flow-pool-backend", backend]
    returncode, output = _run_in_own_group(command, workdir, env)
    return returncode, output, world


def run_decoupled(job: Job, layout: dict, workdir: Path, load: Path, backend: str,
                  packs: list | None = None) -> list[dict]:
    """:func:`start_decoupled`, which must succeed; every rank's result and gradients."""
    returncode, output, world = start_decoupled(job, layout, workdir, load, backend, packs=packs)
    if returncode != 0:
        raise RuntimeError(f"decoupled run failed ({returncode}) in {workdir}\n{output[-30000:]}")
    results = [json.loads((workdir / f"result_{r}.json").read_text()) for r in range(world)]
    for r in results:
        r["grads"] = torch.load(workdir / f"grads_{r['rank']}.pt", weights_only=True)
    return results


def slice_zero(results: list[dict]) -> dict[str, torch.Tensor]:
    """The gradients of slice 0's first encoder replica and its backbone stages (the other
    replicas hold the same, all-reduced gradients: checked too)."""
    grads: dict[str, torch.Tensor] = {}
    for r in results:
        if r["replica"] == 0 and (r["region"] == "llm" or r["plan_rank"] == 0):
            for name, grad in r["grads"].items():
                assert name not in grads, f"{name} on two ranks"
                grads[name] = grad
    for r in results:  # every replica holds its role's reduced gradients
        for name, grad in r["grads"].items():
            assert torch.equal(grad, grads[name]), f"rank {r['rank']}: {name} differs from slice 0's"
    return grads


def assert_equals_upstream(reference, results: list[dict]) -> None:
    """MindSpeed-MM's reported loss is summed over the data-parallel group (the backbone's),
    so every slice's last stage reports the global batch's."""
    last = [r for r in results if "loss_sum" in r]
    assert len({(r["loss_sum"], r["tokens"]) for r in last}) == 1, last
    tokens = last[0]["tokens"]
    loss = last[0]["loss_sum"] / tokens
    assert tokens == reference.result["tokens"]
    assert loss == pytest.approx(reference.loss, rel=FP32_LOSS_RTOL)
    errors = gradient_errors(reference.grads, slice_zero(results))
    worst = max(errors, key=errors.get)
    assert errors[worst] <= FP32_GRAD_RTOL, f"{worst}: relative gradient error {errors[worst]:.2e}"
    # --clip-grad's norm (Megatron's optimizer on every rank): the whole model's, both roles
    norm = sum(float(g.double().pow(2).sum()) for g in reference.grads.values()) ** 0.5
    for r in results:
        assert r["grad_norm"] == pytest.approx(norm, rel=FP32_GRAD_RTOL), (r["rank"], r["region"], r["grad_norm"])


def assert_roles(results: list[dict], layout: dict, backend: str) -> None:
    """Encoder ranks hold image_encoder.* only, backbone ranks text_decoder.* only; every
    Megatron group (TP, PP, DP, model parallel) holds ranks of one role; the step ran the
    decoupled runtime; the pool is gone after the job."""
    encoders = layout["backbone_dp"] * layout["encoder_dp"]
    for r in results:
        prefix = "module.image_encoder." if r["region"] == "vit" else "module.text_decoder."
        assert r["parameters"] and all(n.startswith(prefix) for n in r["parameters"]), r["rank"]
        mine = range(encoders) if r["region"] == "vit" else range(encoders, len(results))
        for kind, ranks in r["groups"].items():
            assert set(ranks) <= set(mine), (r["rank"], kind, ranks)
        assert r["forward_backward_func"] == DECOUPLED_STEP
        assert r["pool_backend"] == backend
        assert not list(SHM.glob(f"*{r['pool_name']}*")), "the pool outlived the job"


def test_decoupled_vit_on_one_rank_llm_pp2_equals_upstream(runs, tmp_path):
    """ViT on rank 0, LLM stages on ranks 1 and 2 (3 ranks), the ``shm`` pool; Megatron's
    PP group is the backbone's two ranks, its DP groups one rank each."""
    plain = runs.get("fp32_plain")
    layout = {"encoder_dp": 1, "backbone_pp": 2, "backbone_dp": 1, "max_ahead": 2}
    job = Job(samples=sample_specs(3), precision="fp32", flash_attn=True, pp=2)
    results = run_decoupled(job, layout, tmp_path / "decoupled_pp2", plain.initial_weights, "shm")
    assert_roles(results, layout, "shm")
    assert [r["groups"]["pp"] for r in results] == [[0], [1, 2], [1, 2]]
    assert_equals_upstream(plain, results)


def test_two_vit_replicas_feeding_llm_pp2_equal_upstream(runs, tmp_path):
    """Two ViT replicas (ranks 0, 1) feed one LLM pipeline (ranks 2, 3): each encodes every
    other microbatch of the slice; DDP averages their gradients over the ViT's DP group (the 2
    encoder ranks), and the gradient norm counts the ViT once (the second replica's
    parameters are marked shared)."""
    job = Job(samples=sample_specs(4), precision="fp32", flash_attn=True)
    plain = run_upstream(job, tmp_path / "plain4")
    layout = {"encoder_dp": 2, "backbone_pp": 2, "backbone_dp": 1, "max_ahead": 2}
    results = run_decoupled(replace(job, pp=2), layout, tmp_path / "decoupled_vit2_pp2", plain.initial_weights,
                            "shm")
    assert_roles(results, layout, "shm")
    assert [r["groups"]["dp"] for r in results] == [[0, 1], [0, 1], [2], [3]]
    assert_equals_upstream(plain, results)


def test_an_encoder_rank_dying_mid_step_ends_every_rank_naming_it_and_the_pool_goes(runs, tmp_path):
    """The ViT rank (rank 0) of the 3-rank layout ends (``os._exit(17)``, no clean-up of its
    own) at its second forward, with embeddings in the ``shm`` pool: the job fails naming
    rank 0 and its exit code, no rank is left running (the run returned), no rank wrote a
    result, and the survivors removed the job's pool from ``/dev/shm``."""
    plain = runs.get("fp32_plain")
    layout = {"encoder_dp": 1, "backbone_pp": 2, "backbone_dp": 1, "max_ahead": 2}
    job = Job(samples=sample_specs(3), precision="fp32", flash_attn=True, pp=2)
    started = time.monotonic()
    returncode, output, world = start_decoupled(job, layout, tmp_path / "dies", plain.initial_weights, "shm",
                                                die={"rank": 0, "call": 2, "code": 17})
    elapsed = time.monotonic() - started
    assert returncode != 0, output[-3000:]
    assert "rank 0 dies at forward 2" in output
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s*\n\s*exitcode\s*:\s*17", output), output[-3000:]
    assert not list((tmp_path / "dies").glob("result_*.json"))
    assert_no_pool_left(output)
    assert elapsed < 300


def test_decoupled_vit_dp2_llm_dp2_equals_upstream(runs, tmp_path):
    """Two slices of one ViT rank and one LLM rank each (4 ranks): the ViT's DP group is
    the 2 encoder ranks, the LLM's the 2 backbone ranks; each slice trains 2 of the 4 samples; the ``torch`` pool (point-to-point).  (``runs``:
    skips where MindSpeed-MM's dependencies are absent, as the other tests here do.)"""
    job = Job(samples=sample_specs(4), precision="fp32", flash_attn=True)
    plain = run_upstream(job, tmp_path / "plain4")
    layout = {"encoder_dp": 1, "backbone_pp": 1, "backbone_dp": 2, "max_ahead": 2}
    results = run_decoupled(job, layout, tmp_path / "decoupled_dp2", plain.initial_weights, "torch")
    assert_roles(results, layout, "torch")
    assert {tuple(r["groups"]["dp"]) for r in results} == {(0, 1), (2, 3)}
    assert_equals_upstream(plain, results)



# ------------------------------------------------------------------ pretrain_vlm.py itself

DECOUPLED_LAYOUT_FILE = HERE / "decoupled_layout.yaml"


def _real_decoupled():
    """``pretrain_vlm.py`` with ``--use-flowtrain`` and the decoupled layout file (3 ranks)."""
    from realjob import RealJob
    from test_real_job import FLOW

    return RealJob(pp=2, world_size=3, plugin=FLOW + ("--flow-schedule-config", str(DECOUPLED_LAYOUT_FILE)),
                   timeout_s=600)


def assert_no_pool_left(output: str) -> None:
    """Every pool the job opened (rank 0 logs their names) is gone from /dev/shm.  By name: other
    jobs on the machine (the main suite's pool tests, in CI's other lane) may hold pools of their
    own meanwhile."""
    names = re.findall(r"mindspeed-flow pool: shm pools named (mjob\d+x\d+)-b<slice> open", output)
    assert names, output[-3000:]
    for name in names:
        assert not list(SHM.glob(f"*{name}*")), f"the pool {name} outlived the job"


def _fed_by_rank(run, rank: int) -> list[list[int]]:
    """The sample tags of every training batch ``rank``'s model got, per batch, in order."""
    return [[t for row in b["rows"] for seg in row for t in seg["tags"]]
            for b in run.batches if b.get("rank") == rank and b.get("training")]


@pytest.mark.timeout(1200)
def test_pretrain_vlm_decoupled_runs_8_iterations_feeding_the_colocated_samples(real_jobs):
    """``pretrain_vlm.py`` itself, started as users start it, with ``--use-flowtrain`` and
    ``--flow-schedule-config decoupled_layout.yaml`` on 3 ranks: the ViT + projector on rank 0
    of its own, the LLM's 2 stages on ranks 1-2, embeddings through the ``shm`` pool (the
    one-node default).  8 iterations finish; the encoder rank and the LLM's first stage are fed
    exactly the packs the co-located ``--use-flowtrain`` PP=2 run feeds its stage 0, in its
    order; consumed samples are counted once per replica (as co-located); the log says the pool
    opened; no pool is left in /dev/shm.  (The losses are not compared: each role draws its
    own initial parameters from Megatron's per-rank seeds, so the two runs start from other
    weights; the one-step tests above hold the math against upstream from the same weights.)"""
    from test_real_job import assert_finished
    from test_real_job_pipeline import PIPELINE_JOBS

    run = real_jobs.run("decoupled_vit1_pp2", _real_decoupled())
    assert_finished(run)
    colocated = real_jobs.run("flow_pp2", PIPELINE_JOBS["flow_pp2"])
    packs = _fed_by_rank(colocated, 0)
    assert packs and _fed_by_rank(run, 0) == packs  # the encoder rank
    assert _fed_by_rank(run, 1) == packs  # the LLM's first stage
    assert run.consumed == colocated.consumed
    assert "mindspeed-flow pool: backend shm, one pool per slice of the decoupled layout (encoder dp 1 x tp 1, " \
           "backbone dp 1 x tp 1 x pp 2, 3 ranks)" in run.output, run.output[-3000:]
    assert_no_pool_left(run.output)


@pytest.mark.timeout(1800)
def test_pretrain_vlm_decoupled_resume_continues_bit_for_bit(real_jobs):
    """Save at K and exit, resume to ITERS (``--ckpt-format torch``): each role writes the
    files of its own Megatron config (the encoder rank ``mp_rank_00``: ``image_encoder.*``;
    the LLM's stages ``mp_rank_00_000`` / ``_001``: ``text_decoder.*``), with its optimizer
    state and the decoding ranks' loader states; the resumed run is the uninterrupted one bit
    for bit, every sample fed once."""
    from test_real_job import ITERS, K, assert_finished
    from test_real_job_ckpt import _PICKLE

    base = _real_decoupled()
    first = real_jobs.run("decoupled_vit1_pp2_save", replace(base, save="ckpt", save_interval=K, exit_interval=K))
    assert_finished(first, last=K)
    step = first.workdir / "ckpt" / f"iter_{K:07d}"
    files = {d.name: torch.load(d / "model_optim_rng.pt", map_location="cpu", weights_only=False, pickle_module=_PICKLE)
             for d in sorted(step.iterdir()) if d.name.startswith("mp_rank_")}
    assert sorted(files) == ["mp_rank_00", "mp_rank_00_000", "mp_rank_00_001"]
    for name, state in files.items():
        prefix = "image_encoder." if name == "mp_rank_00" else "text_decoder."
        assert state["model"] and all(k.startswith(prefix) for k in state["model"]), (name, list(state["model"])[:3])
        assert state["optimizer"]["optimizer"]["state"], f"{name}: no optimizer state"
    second = real_jobs.run("decoupled_vit1_pp2_resume", replace(base, load=str(first.workdir / "ckpt")))
    assert_finished(second, first=K + 1, last=ITERS)
    whole = real_jobs.run("decoupled_vit1_pp2", base)
    assert {**first.exact_losses, **second.exact_losses} == whole.exact_losses
    assert {**first.consumed, **second.consumed} == whole.consumed
    for rank in range(3):  # no sample twice, none skipped, same order, on every rank
        assert _fed_by_rank(first, rank) + _fed_by_rank(second, rank) == _fed_by_rank(whole, rank), rank


@pytest.mark.timeout(1200)
def test_pretrain_vlm_encoder_rank_dying_mid_step_ends_every_rank_naming_it(real_jobs):
    """``pretrain_vlm.py`` on the decoupled layout; the encoder rank (rank 0) ends with
    ``os._exit(17)`` at its 6th training forward (iteration 2's second pack: the first one's
    embeddings are in the pool, the LLM's stages wait for the next).  The job fails naming
    rank 0 and its exit code within the layout's runtime timeout (300 s, start-up included);
    torchrun's run returned, so no rank is left; no pool is left in /dev/shm."""
    job = replace(_real_decoupled(), env=(("REALJOB_DIE_AT", "0:6:17"),))
    run = real_jobs.run("decoupled_vit1_pp2_dies", job, check=False)
    assert run.returncode != 0, run.output[-3000:]
    assert "fault injection: rank 0 dies at training forward 6" in run.output
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s*\n\s*exitcode\s*:\s*17", run.output), run.output[-3000:]
    assert run.wall_s < 300, run.wall_s
    assert_no_pool_left(run.output)


ALLOCATOR_CONFIG = HERE / "allocator_decoupled.yaml"


@pytest.mark.timeout(1200)
def test_a_decoupled_plan_of_mindspeed_flow_plan_starts_pretrain_vlm(real_jobs, tmp_path):
    """``mindspeed-flow plan allocator_decoupled.yaml --out plan.yaml`` (HiGHS over the real
    job's tiny Qwen2.5-VL on 3 ranks, decoupled only, ``encoder_split``) chooses the ViT on 1
    rank and the LLM at PP=2; ``pretrain_vlm.py`` started with the script's own PP=1 and
    ``--flow-allocator --flow-allocator-plan plan.yaml`` runs exactly that layout: its run is
    the one of ``--flow-schedule-config decoupled_layout.yaml`` (the same sizes) bit for bit,
    losses and packs on every rank."""
    import subprocess

    from mindspeed_flow.allocator.plan import AllocationPlan
    from realjob import RealJob
    from test_real_job import FLOW, assert_finished

    plan_file = tmp_path / "plan.yaml"
    printed = subprocess.run([sys.executable, "-c", "import sys; from mindspeed_flow.cli import main; sys.exit(main())",
                              "plan", str(ALLOCATOR_CONFIG), "--out", str(plan_file)],
                             capture_output=True, text=True, timeout=300)
    assert printed.returncode == 0, printed.stdout + printed.stderr
    assert "--flow-allocator-plan PLAN.yaml" in printed.stdout
    plan = AllocationPlan.load(plan_file)
    assert (plan.placement, plan.encoder.dp, plan.encoder.tp, plan.backbone.dp, plan.backbone.tp, plan.backbone.pp) \
        == ("decoupled", 1, 1, 1, 1, 2)
    job = RealJob(pp=1, world_size=3, timeout_s=600,
                  plugin=FLOW + ("--flow-allocator", "--flow-allocator-plan", str(plan_file)))
    run = real_jobs.run("decoupled_from_plan", job)
    assert_finished(run)
    assert "pipeline_model_parallel_size 1 -> 2" in run.output, run.output[-3000:]
    by_file = real_jobs.run("decoupled_vit1_pp2", _real_decoupled())
    assert run.exact_losses == by_file.exact_losses
    for rank in range(3):
        assert _fed_by_rank(run, rank) == _fed_by_rank(by_file, rank), rank


@pytest.mark.timeout(1800)
def test_checkpoints_cross_between_the_decoupled_and_the_colocated_layout(real_jobs):
    """A co-located ``--use-flowtrain`` PP=2 run saved at K resumes in the decoupled layout, and
    a decoupled run saved at K resumes co-located (``--ckpt-format torch``, optimizer state
    loaded): the pool feature writes each file's optimizer parameter names, and the loading
    rank assembles its checkpoint from the other layout's files by name (the encoder rank from
    stage 0's ``image_encoder.*``, co-located stage 0 from the encoder's and the first stage's
    files).  Each resumed run continues the curve of the run that saved (the same weights,
    Adam moments, scheduler, data position: BF16_RTOL per iteration; measured here: bit for
    bit) and is fed that run's packs."""
    from test_real_job import BF16_RTOL, ITERS, K, assert_finished
    from test_real_job_pipeline import PIPELINE_JOBS

    colocated, decoupled = PIPELINE_JOBS["flow_pp2"], _real_decoupled()
    co_saved = real_jobs.run("flow_pp2_save", replace(colocated, save="ckpt", save_interval=K, exit_interval=K))
    dec_saved = real_jobs.run("decoupled_vit1_pp2_save", replace(decoupled, save="ckpt", save_interval=K,
                                                                 exit_interval=K))
    legs = {
        "decoupled from co-located": (real_jobs.run("decoupled_from_colocated", replace(
            decoupled, load=str(co_saved.workdir / "ckpt"))), real_jobs.run("flow_pp2", colocated)),
        "co-located from decoupled": (real_jobs.run("colocated_from_decoupled", replace(
            colocated, load=str(dec_saved.workdir / "ckpt"))), real_jobs.run("decoupled_vit1_pp2", decoupled)),
    }
    for leg, (resumed, whole) in legs.items():
        assert_finished(resumed, first=K + 1, last=ITERS)
        for i in range(K + 1, ITERS + 1):
            assert resumed.exact_losses[i] == pytest.approx(whole.exact_losses[i], rel=BF16_RTOL), (leg, i)
        assert {i: c for i, c in whole.consumed.items() if i > K} == resumed.consumed, leg
        packs = _fed_by_rank(resumed, 0)
        assert packs and _fed_by_rank(whole, 0)[-len(packs):] == packs, leg  # the saved run's next packs


CLIP = 0.05  # below every iteration's gradient norm of the tiny model: Megatron clips every step


def _grad_norms(run, rank: int) -> dict[int, float]:
    """Iteration -> the gradient norm ``train_step`` returned on ``rank`` (Megatron's
    optimizer computes it for ``--clip-grad``)."""
    return {s["iteration"]: s["grad_norm"] for s in run._of("step") if s["rank"] == rank}


def _clipped_colocated(real_jobs):
    """The co-located ``--use-flowtrain`` PP=2 run with ``--clip-grad CLIP``, saving at K (and
    at ITERS)."""
    from test_real_job import K
    from test_real_job_pipeline import PIPELINE_JOBS

    return real_jobs.run("flow_pp2_clip", replace(PIPELINE_JOBS["flow_pp2"], save="ckpt", save_interval=K,
                                                  extra_args=("--clip-grad", str(CLIP))))


def _resumed_from(colocated, job):
    """``job`` loading ``colocated``'s iteration K, with its ``--clip-grad``."""
    from test_real_job import K

    return replace(job, load=str(colocated.workdir / "ckpt"),
                   extra_args=("--clip-grad", str(CLIP), "--ckpt-step", str(K)))


def _assert_continues_clipped(colocated, resumed, ranks: int) -> None:
    """Iterations K+1..ITERS: every rank's gradient norm and the losses are the co-located
    run's (BF16_RTOL), and each norm is above CLIP (Megatron clipped every step)."""
    from test_real_job import BF16_RTOL, ITERS, K, assert_finished

    assert_finished(colocated)
    assert_finished(resumed, first=K + 1, last=ITERS)
    whole = {i: n for i, n in _grad_norms(colocated, 0).items() if i > K}  # (the same on every rank)
    assert sorted(whole) == list(range(K + 1, ITERS + 1)) and all(n > CLIP for n in whole.values()), whole
    for rank in range(ranks):
        norms = _grad_norms(resumed, rank)
        assert sorted(norms) == sorted(whole), (rank, norms)
        for i, norm in whole.items():
            assert norms[i] == pytest.approx(norm, rel=BF16_RTOL), (rank, i, norms[i], norm)
    for i in whole:
        assert resumed.exact_losses[i] == pytest.approx(colocated.exact_losses[i], rel=BF16_RTOL), i


@pytest.mark.timeout(1800)
def test_gradient_clipping_in_pretrain_vlm_takes_the_whole_models_norm(real_jobs):
    """``--clip-grad`` inside ``pretrain_vlm.py`` itself, decoupled: a co-located
    ``--use-flowtrain`` PP=2 run with ``--clip-grad 0.05`` saves at K and goes on to ITERS; the
    decoupled layout resumes from its iteration K (``--ckpt-step``).  Megatron's optimizer clips
    every one of these steps (each norm is above 0.05), by the norm of the whole model's
    gradients: on every decoupled rank (the encoder rank included) the norm is the co-located
    run's, and so are the losses (BF16_RTOL).  A norm over one role's parameters only (Megatron's
    model-parallel group of that role) would scale the two roles' gradients differently."""
    colocated = _clipped_colocated(real_jobs)
    resumed = real_jobs.run("decoupled_clip_from_colocated", _resumed_from(colocated, _real_decoupled()))
    _assert_continues_clipped(colocated, resumed, ranks=3)


VIT_DP2_LAYOUT_FILE = HERE / "decoupled_layout_vit_dp2.yaml"


@pytest.mark.timeout(1800)
def test_two_vit_replicas_in_pretrain_vlm_feed_their_slice_and_clip_by_the_whole_model(real_jobs):
    """``pretrain_vlm.py`` with ``decoupled_layout_vit_dp2.yaml`` (4 ranks: two ViT replicas,
    the LLM's 2 stages), resumed from the clipped co-located run's iteration K: the plugin's
    loader gives both replicas their slice's packs (the first stage's, in its order: the
    co-located run's next packs), replica e forwards microbatches m % 2 == e, and the step is
    the co-located one: every rank's gradient norm (the ViT counted once) and the losses."""
    from realjob import RealJob
    from test_real_job import FLOW

    colocated = _clipped_colocated(real_jobs)
    job = RealJob(pp=2, world_size=4, plugin=FLOW + ("--flow-schedule-config", str(VIT_DP2_LAYOUT_FILE)),
                  timeout_s=600)
    resumed = real_jobs.run("decoupled_vit2_clip_from_colocated", _resumed_from(colocated, job))
    _assert_continues_clipped(colocated, resumed, ranks=4)
    first_stage = _fed_by_rank(resumed, 2)
    assert first_stage and _fed_by_rank(colocated, 0)[-len(first_stage):] == first_stage
    assert _fed_by_rank(resumed, 0) == first_stage[0::2]
    assert _fed_by_rank(resumed, 1) == first_stage[1::2]


TP2_LAYOUT_FILE = HERE / "decoupled_layout_tp2.yaml"


@pytest.mark.timeout(1800)
def test_pretrain_vlm_decoupled_with_tp2_in_both_roles_continues_the_colocated_tp2_run(real_jobs):
    """Tensor parallelism in both roles (``decoupled_layout_tp2.yaml``: the ViT at TP 2 on
    ranks 0-1, the LLM at TP 2 x PP 2 on ranks 2-5): resumed from iteration K of a co-located
    ``--use-flowtrain`` TP 2 x PP 2 run with ``--clip-grad`` (its files are each TP rank's
    shards; the encoder's TP ranks take the ViT's from stage 0's), it continues that run's
    curve: every rank's gradient norm (each TP shard counted once over the slice) and the
    losses, and the LLM's first stage is fed the co-located run's next packs."""
    from realjob import RealJob
    from test_real_job import FLOW, K
    from test_real_job_pipeline import SLOW

    colocated = real_jobs.run("flow_tp2_pp2_clip", RealJob(pp=2, tp=2, plugin=FLOW, timeout_s=SLOW, save="ckpt",
                                                           save_interval=K, extra_args=("--clip-grad", str(CLIP))))
    job = RealJob(pp=2, tp=2, world_size=6, plugin=FLOW + ("--flow-schedule-config", str(TP2_LAYOUT_FILE)),
                  timeout_s=600)
    resumed = real_jobs.run("decoupled_tp2_clip_from_colocated", _resumed_from(colocated, job))
    _assert_continues_clipped(colocated, resumed, ranks=6)
    first_stage = _fed_by_rank(resumed, 2)
    assert first_stage and _fed_by_rank(colocated, 0)[-len(first_stage):] == first_stage
    assert "(encoder dp 1 x tp 2, backbone dp 1 x tp 2 x pp 2, 6 ranks)" in resumed.output
