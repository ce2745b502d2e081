"""FlowTrain's flow in MindSpeed-MM's job (issue 23, "Where it runs"): the decoupled layout with
``flow: true`` (``adapters/megatron/decoupled_flow.py``).  The encoder rank encodes the step's
samples in batches of its own (ViT patches per batch, ``flow_encoder_batch_patches``) and
puts one pool entry per sample; the LLM's first stage takes each microbatch's samples'
embeddings by key and, for a trainable ViT, puts each sample's gradient back.

- One step (``decoupled_driver.py``, MindSpeed-MM's real Qwen2.5-VL, fp32, ViT rank + LLM
  PP=2, from upstream's initial weights): the loss and every gradient by global name equal
  upstream's co-located single-process step within ``test_vlm_equivalence``'s fp32 bounds,
  trainable ViT and frozen ViT (no ViT gradient; the LLM's equal upstream's), while the
  encoder's batches are not the LLM's microbatches.
- ``pretrain_vlm.py`` itself, started as users start it, with ``flow_layout.yaml``: 8
  iterations; the LLM's first stage is fed the co-located ``--use-flowtrain`` PP=2 run's
  packs, the encoder rank the same samples, each once per iteration, in batches that are not
  those packs; the pools are gone after.
- The same with a frozen ViT: its encoder rank runs ahead into the next step (it encodes and
  puts step ``n+1``'s samples during step ``n``, never after the last step); the LLM's first
  stage is fed the packs of the trainable ViT's run (which encodes within the step), every
  sample reaches the encoder once.  That run saves at K with the encoder ahead (and goes
  on); resumed from K to ITERS: losses and every backbone rank's fed samples bit for bit as
  uninterrupted; what was encoded ahead at K is encoded again after the
  resume (the checkpoint holds the trained step's loader position).
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from harness import Job, sample_specs
from test_real_job_decoupled import (assert_equals_upstream, assert_no_pool_left, assert_roles, run_decoupled,
                                     slice_zero)
from test_real_job_transpose import TransposedJob, is_vit
from test_vlm_equivalence import FP32_GRAD_RTOL, FP32_LOSS_RTOL, gradient_errors

HERE = Path(__file__).resolve().parent
FLOW_LAYOUT_FILE = HERE / "flow_layout.yaml"
# ViT patches per encoder batch in the one-step tests: the samples' images have 64, 24 and 24
# patches (harness.sample_specs), so the encoder's batches are [0] and [1, 2] while the LLM's
# microbatches are [0], [1], [2] (one sample each, as the driver feeds them).
ONE_STEP_BATCH_PATCHES = 48
AHEAD_LOG = re.compile(r"mindspeed-flow flow: step (\d+): ran ahead into step (\d+): (\d+) of (\d+) batches")
FROZEN_VIT = (("image_encoder.vision_encoder.freeze", True), ("image_encoder.vision_projector.freeze", True))
FLOW_LOG = re.compile(r"mindspeed-flow flow: step (\d+): LLM microbatches (\[.*?\]\]), encoder batches (\[.*?\]\])")


def groupings(output: str) -> dict[int, tuple[list, list]]:
    """Step -> (LLM microbatches, encoder batches) as the encoder rank logged them (sample ids)."""
    return {int(step): (json.loads(llm), json.loads(enc)) for step, llm, enc in FLOW_LOG.findall(output)}


def one_step_layout() -> dict:
    return {"encoder_dp": 1, "backbone_pp": 2, "backbone_dp": 1, "max_ahead": 2, "flow": True,
            "flow_encoder_batch_patches": ONE_STEP_BATCH_PATCHES}


def test_flow_step_with_a_trainable_vit_equals_upstream(runs, tmp_path):
    """Loss and every gradient (ViT by the encoder rank's per-batch backwards of the samples'
    returned gradients, LLM stages) within fp32 bounds of upstream's step; the encoder's
    batches (by patches) are not the LLM's microbatches; the pool is gone after."""
    plain = runs.get("fp32_plain")
    job = Job(samples=sample_specs(3), precision="fp32", flash_attn=True, pp=2)
    results = run_decoupled(job, one_step_layout(), tmp_path / "flow_trainable", plain.initial_weights, "shm")
    assert_roles(results, one_step_layout(), "shm")
    assert_equals_upstream(plain, results)
    flow = [r["flow"] for r in results if r.get("flow")]
    assert flow, "no rank ran the flow"
    (llm, encoder), = {(json.dumps(f["microbatches"]), json.dumps(f["batches"])) for f in flow}
    assert json.loads(llm) == [[0], [1], [2]] and json.loads(encoder) == [[0], [1, 2]]


def test_flow_step_with_a_fitted_encoder_cost_cuts_other_batches_and_equals_upstream(runs, tmp_path):
    """``flow_encoder_cost`` in the layout: with an image's fixed work as dear as 48 patches,
    the budget (one image of 48 patches: 96) holds no two of the samples' images (64, 24, 24
    patches), so the encoder's batches are ``[0] [1] [2]`` where patches make ``[0] [1, 2]``
    (both :func:`group_packed` on the samples' metas, the first also the job's); the loss and
    every gradient still equal upstream's step."""
    from mindspeed_flow.decoupled import DecoupledLayout
    from mindspeed_flow.flow import EncoderCost, SampleMeta
    from mindspeed_flow.flow.packed import group_packed

    terms = {"quadratic": 0.0, "linear": 1.0, "per_image": 48.0}
    metas = [SampleMeta(i, 0, 1, 0, (p,)) for i, p in enumerate((64, 24, 24))]
    expected = {}
    for name, cost in (("patches", None), ("fitted", EncoderCost(**terms))):
        lay = DecoupledLayout(flow=True, flow_encoder_batch_patches=ONE_STEP_BATCH_PATCHES, flow_encoder_cost=cost)
        grouping = group_packed(metas, [[0], [1], [2]], encoder_cost=lay.flow_encoder_model,
                                encoder_budget=lay.flow_encoder_budget, encoder_replicas=1, pp=2)
        expected[name] = [list(batch) for batch in grouping.batches]
    assert expected["patches"] == [[0], [1, 2]] and expected["fitted"] == [[0], [1], [2]]
    plain = runs.get("fp32_plain")
    job = Job(samples=sample_specs(3), precision="fp32", flash_attn=True, pp=2)
    layout = {**one_step_layout(), "flow_encoder_cost": terms}
    results = run_decoupled(job, layout, tmp_path / "flow_encoder_cost", plain.initial_weights, "shm")
    assert_equals_upstream(plain, results)
    flow = [r["flow"] for r in results if r.get("flow")]
    assert flow and {json.dumps(f["batches"]) for f in flow} == {json.dumps(expected["fitted"])}


@pytest.fixture(scope="module")
def plain4(runs, tmp_path_factory):
    """Upstream's co-located single-process step on 4 samples (the reference of the 4-rank layouts);
    ``runs``: the upstream environment's gate (skips in the main suite's environment)."""
    from harness import run_upstream

    job = Job(samples=sample_specs(4), precision="fp32", flash_attn=True)
    return job, run_upstream(job, tmp_path_factory.mktemp("flow_plain4"))


def test_two_vit_replicas_share_the_encoder_batches_and_the_step_equals_upstream(plain4, tmp_path):
    """Two ViT replicas (ranks 0, 1) feed one LLM pipeline (ranks 2, 3): the encoder's batches
    ``[0] [1, 2] [3]`` (64, 24 + 24, 16 patches) go to the replica with the least patches so
    far (replica 0 ``[0]``, replica 1 the others); the replicas' gradients are summed, then
    averaged by Megatron's DDP over the ViT's DP group (the 2 encoder ranks); loss, every
    gradient and the norm (the second replica's parameters marked shared) equal upstream's."""
    job, plain = plain4
    layout = {**one_step_layout(), "encoder_dp": 2}
    results = run_decoupled(replace(job, pp=2), layout, tmp_path / "flow_vit2", plain.initial_weights, "shm")
    assert_roles(results, layout, "shm")
    assert [r["groups"]["dp"] for r in results] == [[0, 1], [0, 1], [2], [3]]
    assert_equals_upstream(plain, results)
    encoders = [r["flow"] for r in results if r["region"] == "vit"]
    assert [e["batches"] for e in encoders] == [[[0], [1, 2], [3]]] * 2
    assert [e["forwards"] for e in encoders] == [1, 2] and [e["backwards"] for e in encoders] == [1, 2]


def test_two_slices_each_a_vit_rank_and_an_llm_rank_equal_upstream(plain4, tmp_path):
    """LLM PP=1 x DP=2, one ViT rank per slice (4 ranks): each slice's flow runs on its own
    pool over its own 2 samples, one per LLM microbatch (slice 0: 64 and 24 patches, two
    encoder batches; slice 1: 24 and 16, one); Megatron's DDP averages each role over its 2
    ranks; the loss and every gradient equal upstream's."""
    job, plain = plain4
    layout = {**one_step_layout(), "backbone_pp": 1, "backbone_dp": 2}
    results = run_decoupled(job, layout, tmp_path / "flow_dp2", plain.initial_weights, "shm")
    assert_roles(results, layout, "shm")
    assert {tuple(r["groups"]["dp"]) for r in results} == {(0, 1), (2, 3)}
    assert_equals_upstream(plain, results)
    assert sorted(r["flow"]["taken"] for r in results if r["region"] == "llm") == [2, 2]
    assert [r["flow"]["batches"] for r in results if r["region"] == "vit"] == [[[0], [1]], [[0, 1]]]


def test_flow_step_with_a_frozen_vit_equals_upstream(runs, tmp_path):
    """Frozen ViT (``vision_encoder.freeze`` and ``vision_projector.freeze``): no gradient goes
    back through the pool and no ViT parameter has one; the loss and the LLM's gradients equal
    upstream's trainable step's (freezing the ViT changes no LLM gradient)."""
    plain = runs.get("fp32_plain")
    job = TransposedJob(samples=sample_specs(3), precision="fp32", flash_attn=True, pp=2, vit_frozen=True)
    results = run_decoupled(job, one_step_layout(), tmp_path / "flow_frozen", plain.initial_weights, "shm")
    last = [r for r in results if "loss_sum" in r]
    assert last[0]["tokens"] == plain.result["tokens"]
    assert last[0]["loss_sum"] / last[0]["tokens"] == pytest.approx(plain.loss, rel=FP32_LOSS_RTOL)
    grads = slice_zero(results)
    assert not [n for n, g in grads.items() if is_vit(n) and g.abs().sum() > 0]
    llm = {n: g for n, g in grads.items() if not is_vit(n)}
    errors = gradient_errors({n: g for n, g in plain.grads.items() if not is_vit(n)}, llm)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= FP32_GRAD_RTOL, f"{worst}: {errors[worst]:.2e}"
    assert [r["flow"]["grads_put"] for r in results if r.get("flow") and "grads_put" in r["flow"]] == [0]


# ------------------------------------------------------------------ pretrain_vlm.py itself

def _flow_job():
    """``pretrain_vlm.py`` with ``--use-flowtrain`` and ``flow_layout.yaml`` (3 ranks)."""
    from realjob import RealJob
    from test_real_job import FLOW

    return RealJob(pp=2, world_size=3, plugin=FLOW + ("--flow-schedule-config", str(FLOW_LAYOUT_FILE)),
                   timeout_s=600)


def _fed_by_iteration(run, rank: int) -> dict[int, list[list[str]]]:
    """Iteration -> the sample tags of each training batch ``rank``'s model got in it, in order."""
    fed: dict[int, list[list[str]]] = defaultdict(list)
    for b in run.batches:
        if b.get("rank") == rank and b.get("training"):
            fed[b["iteration"]].append([t for row in b["rows"] for seg in row for t in seg["tags"]])
    return dict(fed)


@pytest.mark.timeout(1200)
def test_pretrain_vlm_with_the_flow_runs_8_iterations_feeding_every_sample_once(real_jobs):
    """``pretrain_vlm.py`` started as users start it, ``--use-flowtrain --flow-schedule-config
    flow_layout.yaml`` on 3 ranks: 8 iterations finish with finite losses; the LLM's first
    stage is fed exactly the packs the co-located ``--use-flowtrain`` PP=2 run feeds its stage
    0, in its order; in every iteration the encoder rank's model is fed exactly that
    iteration's samples, each once, in batches of its own (in some iterations not the packs:
    the run's ViT batches hold at most 64 patches); consumed samples as co-located; the encoder
    rank logged both groupings of every step; no pool is left."""
    from test_real_job import ITERS, assert_finished
    from test_real_job_pipeline import PIPELINE_JOBS

    run = real_jobs.run("flow_vit1_pp2", _flow_job())
    assert_finished(run)
    colocated = real_jobs.run("flow_pp2", PIPELINE_JOBS["flow_pp2"])
    packs = _fed_by_iteration(colocated, 0)
    assert sorted(packs) == list(range(ITERS)) or sorted(packs) == list(range(1, ITERS + 1)), sorted(packs)
    assert _fed_by_iteration(run, 1) == packs  # the LLM's first stage: the loader's packs
    encoder = _fed_by_iteration(run, 0)
    assert sorted(encoder) == sorted(packs)
    for i, batches in encoder.items():  # a tag may be in a step twice (an epoch ends in it): compare counts
        assert Counter(t for b in batches for t in b) == Counter(t for p in packs[i] for t in p), i
    assert [i for i in encoder if encoder[i] != packs[i]], "the encoder's batches were the LLM's packs every time"
    assert run.consumed == colocated.consumed
    logged = groupings(run.output)  # by the flow's sample ids (a pack's segments, numbered in the step)
    assert sorted(logged) == list(range(ITERS)), run.output[-3000:]
    for (step, (microbatches, batches)), i in zip(sorted(logged.items()), sorted(encoder)):
        ids = [s for mb in microbatches for s in mb]
        assert sorted(s for b in batches for s in b) == sorted(ids) == list(range(len(ids))), step  # each once
        assert len(batches) == len(encoder[i]) and len(microbatches) == len(packs[i]), step
    assert_no_pool_left(run.output)


@pytest.mark.timeout(1800)
def test_pretrain_vlm_with_the_flow_resumes_bit_for_bit(real_jobs):
    """Save at K and exit, resume to ITERS (``--ckpt-format torch``): the resumed run is the
    uninterrupted one bit for bit (losses), every sample fed once, in order, on every rank."""
    from test_real_job import ITERS, K, assert_finished

    base = _flow_job()
    first = real_jobs.run("flow_vit1_pp2_save", replace(base, save="ckpt", save_interval=K, exit_interval=K))
    assert_finished(first, last=K)
    second = real_jobs.run("flow_vit1_pp2_resume", replace(base, load=str(first.workdir / "ckpt")))
    assert_finished(second, first=K + 1, last=ITERS)
    whole = real_jobs.run("flow_vit1_pp2", base)
    assert {**first.exact_losses, **second.exact_losses} == whole.exact_losses
    assert {**first.consumed, **second.consumed} == whole.consumed
    for rank in range(3):
        assert {**_fed_by_iteration(first, rank), **_fed_by_iteration(second, rank)} == \
            _fed_by_iteration(whole, rank), rank


def _ran_ahead(output: str) -> dict[int, tuple[int, int, int]]:
    """Step -> (the step it ran ahead into, batches encoded ahead, this replica's batches of it)."""
    return {int(step): (int(into), int(done), int(of)) for step, into, done, of in AHEAD_LOG.findall(output)}


def _tags(batches: list[list[str]]) -> Counter:
    return Counter(t for b in batches for t in b)


def _frozen_job():
    """``_flow_job`` with a frozen ViT, saving at K (and going on to the end): the run the two
    frozen-ViT tests share, uninterrupted and the resume's checkpoint at once."""
    from test_real_job import K

    return replace(_flow_job(), model_patch=FROZEN_VIT, save="ckpt", save_interval=K)


@pytest.mark.timeout(1200)
def test_pretrain_vlm_with_a_frozen_vit_runs_ahead_into_the_next_step(real_jobs):
    """A frozen ViT (``vision_encoder.freeze``, ``vision_projector.freeze``) under the flow:
    after each step but the last the encoder rank reads the next step's microbatches and
    encodes all of its batches (the pool has room), so in iteration ``i`` its model is fed
    iteration ``i + 1``'s samples (the first iteration: its own and the next one's; the last:
    none); every sample reaches the encoder exactly once; the LLM's first stage is fed the
    packs of the trainable ViT's flow run (which does not run ahead) in order, and the same
    consumed samples; no pool is left.  (The MindSpeed-MM loop's frozen-ViT encoder rank has
    a stub optimizer: its log runs, ``roles.training_log_wrapper``.)"""
    from test_real_job import ITERS, assert_finished

    run = real_jobs.run("flow_frozen_vit1_pp2_save", _frozen_job())
    assert_finished(run)
    ahead = _ran_ahead(run.output)
    assert sorted(ahead) == list(range(ITERS - 1)), run.output[-3000:]  # not after the last step
    assert all(into == step + 1 and done == of > 0 for step, (into, done, of) in ahead.items()), ahead
    lockstep = real_jobs.run("flow_vit1_pp2", _flow_job())  # trainable ViT: encodes within the step
    packs = _fed_by_iteration(run, 1)  # the LLM's first stage
    assert packs == _fed_by_iteration(lockstep, 1)
    its = sorted(packs)
    assert len(its) == ITERS
    encoder = {i: _tags(b) for i, b in _fed_by_iteration(run, 0).items()}
    assert sorted(encoder) == its[:-1]  # the last step was encoded during the one before
    assert encoder[its[0]] == _tags(packs[its[0]]) + _tags(packs[its[1]])
    for i, nxt in zip(its[1:-1], its[2:]):
        assert encoder[i] == _tags(packs[nxt]), i
    assert sum(encoder.values(), Counter()) == sum((_tags(p) for p in packs.values()), Counter())
    assert run.consumed == lockstep.consumed
    assert sorted(groupings(run.output)) == list(range(ITERS))
    assert_no_pool_left(run.output)


@pytest.mark.timeout(1800)
def test_pretrain_vlm_with_a_frozen_vit_ahead_at_the_save_resumes_bit_for_bit(real_jobs):
    """The frozen-ViT run saves at K while its encoder rank has encoded step K + 1's samples
    ahead (logged) and goes on; resumed from that checkpoint (``--ckpt-step K``) to ITERS:
    losses and consumed samples bit for bit as the saving (uninterrupted) run's; every
    backbone rank is fed the same samples in the same order (none lost, none twice); the
    encoder rank encodes the samples it had encoded ahead again after the resume (the
    checkpoint's loader position is the trained step's).  (Saved without exiting: before an
    ``--exit-interval`` exit the encoder does not run ahead, ``next_is_training_step``.)"""
    from test_real_job import ITERS, K, assert_finished

    whole = real_jobs.run("flow_frozen_vit1_pp2_save", _frozen_job())
    assert_finished(whole)
    assert _ran_ahead(whole.output)[K - 1][0] == K, whole.output[-3000:]  # ahead into step K at the save
    resumed = real_jobs.run("flow_frozen_vit1_pp2_resume", replace(
        _frozen_job(), save=None, save_interval=None, load=str(whole.workdir / "ckpt"),
        extra_args=("--ckpt-step", str(K))))
    assert_finished(resumed, first=K + 1, last=ITERS)
    assert resumed.exact_losses == {i: v for i, v in whole.exact_losses.items() if i > K}
    assert resumed.consumed == {i: v for i, v in whole.consumed.items() if i > K}
    packs = _fed_by_iteration(whole, 1)
    its = sorted(packs)
    for rank in (1, 2):
        fed = _fed_by_iteration(whole, rank)
        assert _fed_by_iteration(resumed, rank) == {i: fed[i] for i in its[K:]}, rank
    encoded_ahead = _tags(packs[its[K]])  # iteration K + 1's samples (0-based its[K])
    before, after = _fed_by_iteration(whole, 0), _fed_by_iteration(resumed, 0)
    assert _tags(before[its[K - 1]]) == encoded_ahead  # encoded ahead during iteration K, then saved
    assert _tags(after[its[K]]) == encoded_ahead + _tags(packs[its[K + 1]])  # encoded again, and ahead again
    assert not list((whole.workdir / "ckpt").rglob("mp_rank_00/flow_loader_*.pt"))  # the encoder wrote none
