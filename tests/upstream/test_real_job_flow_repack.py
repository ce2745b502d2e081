"""The decoupled flow in MindSpeed-MM's job with ``flow_repack: true`` (issue 23, "the backbone's
scheduler packs them into microbatches"): every rank of a slice cuts the packing loader's
packs of the step into samples and packs them again by the LLM's cost model into as many
microbatches, zig-zag over the pipeline (``adapters/megatron/decoupled_flow.py::repack``),
each joined as the loader joins a pack.

- One step (``decoupled_driver.py``, MindSpeed-MM's real Qwen2.5-VL, fp32, ViT rank + LLM
  PP=2, from upstream's initial weights, per-token loss): the loader's packs ``[0, 2] [1]``
  become ``[0, 1] [2]`` (the fill balances the LLM's cost); the loss and every gradient by
  global name equal upstream's co-located single-process step within
  ``test_vlm_equivalence``'s fp32 bounds.
- ``pretrain_vlm.py`` itself, started as users start it, with ``flow_repack_layout.yaml`` and
  ``--calculate-per-token-loss``: a few iterations with finite losses; both LLM stages are
  fed the same repacked microbatches, which differ from the loader's packs in some step;
  every sample of every step reaches the LLM's first stage exactly once (as it reaches the
  encoder rank); no pool is left.
- The two flow features together: ``flow_repack`` with a frozen ViT, whose encoder rank runs
  ahead into the next step (it repacks that step too), ``RESUME_ITERS`` iterations, saving at
  ``RESUME_K`` without stopping (the checkpoint is written while the encoder has read,
  repacked and encoded step ``RESUME_K + 1``; an ``--exit-interval`` exit is foreseen and not
  run ahead into).  That run repacks every step as the trainable ViT's run above (which does
  not run ahead) and feeds the LLM the same samples in the same microbatches.  Resumed from
  ``RESUME_K`` (``--ckpt-step``) to the end: losses, consumed samples, both LLM stages' fed
  samples per iteration and every step's logged repacking bit for bit as the saving run; the
  samples encoded ahead at the save are encoded again after the resume, and every sample the
  LLM is fed after the resume was encoded after it, once (none lost, none twice).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from harness import Job, sample_specs
from test_real_job_decoupled import assert_equals_upstream, assert_no_pool_left, assert_roles, run_decoupled
from test_real_job_flow import FROZEN_VIT, _fed_by_iteration, _ran_ahead, _tags, one_step_layout, plain4  # noqa: F401

HERE = Path(__file__).resolve().parent
REPACK_LAYOUT_FILE = HERE / "flow_repack_layout.yaml"
REPACK_LOG = re.compile(r"mindspeed-flow flow: step (\d+): the loader's packs (\[.*?\]\]) repacked into "
                        r"LLM microbatches (\[.*?\]\]) \(sample ids\) on backbone replicas (\[.*?\])")
ITERS = 4
RESUME_ITERS, RESUME_K = ITERS, 2  # the frozen ViT's runs: as many iterations as the trainable one's, saved at K


def as_sets(groups: list[list[int]]) -> set[frozenset]:
    return {frozenset(g) for g in groups}


def test_repacked_flow_step_equals_upstream(runs, tmp_path):
    """The driver hands every rank of the slice the packs ``[0, 2] [1]`` (27 + 27, 22 tokens);
    the flow packs the samples again into 2 microbatches, ``[0, 1] [2]`` (its dearest
    microbatch is cheaper than the loader's), on every rank; the loss and every gradient
    equal upstream's step over the 3 samples."""
    plain = runs.get("fp32_plain")
    job = Job(samples=sample_specs(3), precision="fp32", flash_attn=True, pp=2,
              extra_args=("--global-batch-size", "2"))  # Megatron's microbatches: the 2 packs
    layout = {**one_step_layout(), "flow_repack": True}
    results = run_decoupled(job, layout, tmp_path / "flow_repack", plain.initial_weights, "shm", packs=[[0, 2], [1]])
    assert_roles(results, layout, "shm")
    assert [r["megatron_microbatches"] for r in results if r["region"] == "llm"] == [2, 2]
    assert_equals_upstream(plain, results)
    groupings = {json.dumps(r["flow"]["microbatches"]) for r in results}
    assert len(groupings) == 1, groupings  # every rank of the slice made the same microbatches
    # the flow numbers the step's samples by their packs' segments: the packs [0, 2] [1] hold ids
    # [0, 1] [2], and [0, 1] [2] of the driver's samples are ids [0, 2] [1]
    assert as_sets(json.loads(groupings.pop())) == {frozenset({0, 2}), frozenset({1})}


def test_two_slices_deal_each_others_samples_and_the_step_equals_upstream(plain4, tmp_path):  # noqa: F811
    """LLM PP=1 x DP=2, one ViT rank per slice (4 ranks), ``flow_repack``: slice 0's loader
    hands it the packs ``[0] [1]``, slice 1's ``[2] [3]`` (the step's sample ids number both
    slices' samples, slice by slice).  Every rank gathers both slices' packs and makes the
    same grouping, dealt over the two replicas by the LLM's cost: some sample read by one
    slice is trained by the other, some sample is encoded by the other slice's ViT rank than
    the one that trains it (through the pool the slices share); each first stage takes
    exactly its replica's samples; the loss and every gradient equal upstream's step over the
    4 samples (per-token loss: the grouping does not change them)."""
    job, plain = plain4
    layout = {**one_step_layout(), "backbone_pp": 1, "backbone_dp": 2, "flow_repack": True}
    results = run_decoupled(job, layout, tmp_path / "flow_dp2_repack", plain.initial_weights, "shm",
                            packs=[[[0], [1]], [[2], [3]]])
    assert_roles(results, layout, "shm")
    assert_equals_upstream(plain, results)
    keys = ("microbatches", "microbatch_replica", "batches", "batch_replica")
    made = {json.dumps({k: r["flow"][k] for k in keys}) for r in results}
    assert len(made) == 1, made  # every rank of both slices made the same grouping
    flow = json.loads(made.pop())
    trained_by = {s: r for mb, r in zip(flow["microbatches"], flow["microbatch_replica"]) for s in mb}
    encoded_by = {s: r for b, r in zip(flow["batches"], flow["batch_replica"]) for s in b}
    read_by = {0: 0, 1: 0, 2: 1, 3: 1}
    assert sorted(trained_by) == sorted(encoded_by) == [0, 1, 2, 3]  # each sample once, on each side
    assert [s for s in read_by if trained_by[s] != read_by[s]], flow  # the deal moved samples between slices
    assert [s for s in read_by if encoded_by[s] != trained_by[s]], flow  # taken from the other slice's ViT rank
    for r in results:
        if r["region"] == "llm":
            assert r["flow"]["replica"] == r["replica"]
            assert r["flow"]["taken"] == sum(1 for s in trained_by.values() if s == r["replica"]), r["rank"]


def _logged(output: str) -> dict[int, tuple[list, list, list]]:
    """Step -> (the loader's packs, the repacked LLM microbatches, each one's backbone
    replica), as every rank logged them (sample ids: a pack's segments, numbered in the step,
    slice 0's packs first); every rank logged the same."""
    found: dict[int, set] = {}
    for logged in REPACK_LOG.findall(output):
        found.setdefault(int(logged[0]), set()).add(logged[1:])
    assert all(len(v) == 1 for v in found.values()), found
    return {step: tuple(json.loads(x) for x in next(iter(v))) for step, v in found.items()}


def _repacks(output: str) -> dict[int, tuple[list, list]]:
    """Step -> (the loader's packs, the repacked LLM microbatches): :func:`_logged`'s."""
    return {step: (packs, microbatches) for step, (packs, microbatches, _) in _logged(output).items()}


@pytest.mark.timeout(1200)
def test_pretrain_vlm_with_repacked_llm_microbatches(real_jobs):
    """``pretrain_vlm.py --use-flowtrain --flow-schedule-config flow_repack_layout.yaml
    --calculate-per-token-loss`` on 3 ranks: ITERS iterations with finite losses; the three
    ranks logged the same repacking of every step (the loader's packs weighed with the others:
    a step the fill cannot fit keeps them); the LLM's two stages are fed the same
    microbatches, of the repacked groups' sizes; in some step they are not the loader's packs;
    in every iteration the LLM's first stage gets each of the step's samples exactly as often
    as the encoder rank (once, but for a sample drawn twice at an epoch's end)."""
    from test_real_job import assert_finished

    run = real_jobs.run("flow_repack_vit1_pp2", _repack_job())
    assert_finished(run, last=ITERS)
    repacks = _repacks(run.output)
    assert sorted(repacks) == list(range(ITERS)), run.output[-3000:]
    for step, (packs, microbatches) in repacks.items():
        ids = sorted(s for mb in microbatches for s in mb)
        assert ids == sorted(s for p in packs for s in p) == list(range(len(ids))), step  # each sample once
        assert len(microbatches) == len(packs), step
    assert [s for s, (packs, mbs) in repacks.items() if as_sets(packs) != as_sets(mbs)], \
        "the LLM's microbatches were the loader's packs in every step"
    first, last, encoder = (_fed_by_iteration(run, rank) for rank in (1, 2, 0))
    assert first == last  # both stages built the same microbatches
    assert sorted(first) == sorted(encoder) and len(first) == ITERS
    segments = _segments_by_iteration(run, 1)
    for (step, (_, microbatches)), i in zip(sorted(repacks.items()), sorted(first)):
        assert Counter(t for b in first[i] for t in b) == Counter(t for b in encoder[i] for t in b), i
        assert segments[i] == [len(mb) for mb in microbatches], i
    assert_no_pool_left(run.output)


def _segments_by_iteration(run, rank: int) -> dict[int, list[int]]:
    """Iteration -> the segments (samples) of each training batch ``rank``'s model got, in order."""
    found: dict[int, list[int]] = {}
    for b in run.batches:
        if b.get("rank") == rank and b.get("training"):
            found.setdefault(b["iteration"], []).append(sum(len(row) for row in b["rows"]))
    return found


def _repack_job():
    """``pretrain_vlm.py`` with ``flow_repack_layout.yaml`` and per-token loss, ITERS iterations (3 ranks)."""
    from realjob import RealJob
    from test_real_job import FLOW, PER_TOKEN

    return RealJob(pp=2, world_size=3, iters=ITERS, extra_args=PER_TOKEN, timeout_s=600,
                   plugin=FLOW + ("--flow-schedule-config", str(REPACK_LAYOUT_FILE)))


@pytest.mark.timeout(1800)
def test_pretrain_vlm_repacking_with_a_frozen_vit_ahead_at_the_save_resumes_bit_for_bit(real_jobs):
    """``flow_repack`` and a frozen ViT (``FROZEN_VIT``) together, saving at K (and at the end).
    The saving run never stops: after every step but the last the encoder rank runs ahead into
    the next one, repacking it as the slice's LLM ranks do when they reach it, so the checkpoint
    at K is written while the encoder has read, repacked and encoded step K + 1 (0-based step
    K; an ``--exit-interval`` exit at K is foreseen and not run ahead into); every step is
    repacked and the LLM fed exactly as in the trainable ViT's repacking run (no run ahead).
    Resumed from K (``--ckpt-step``) to the end: losses, consumed samples, both LLM stages' fed
    samples per iteration and every step's repacking (the resumed job numbers its steps from 0
    again) bit for bit as the saving run; the samples encoded ahead at K are encoded again
    after the resume, and after it the encoder is fed exactly the samples the LLM is fed (none
    lost, none twice)."""
    from test_real_job import PER_TOKEN, assert_finished

    iters, k = RESUME_ITERS, RESUME_K
    base = replace(_repack_job(), iters=iters, model_patch=FROZEN_VIT)
    whole = real_jobs.run("flow_repack_frozen_vit1_pp2_save", replace(base, save="ckpt", save_interval=k))
    assert_finished(whole, last=iters)
    ahead = _ran_ahead(whole.output)
    assert sorted(ahead) == list(range(iters - 1)), whole.output[-3000:]  # ran ahead after every step but the last
    assert all(into == step + 1 and done == of > 0 for step, (into, done, of) in ahead.items()), ahead
    assert ahead[k - 1][0] == k  # in the saved iteration, into the next one
    repacks = _repacks(whole.output)
    assert sorted(repacks) == list(range(iters)), whole.output[-3000:]
    trainable = real_jobs.run("flow_repack_vit1_pp2", _repack_job())  # encodes within the step
    assert repacks == _repacks(trainable.output)  # run ahead or not, each step repacked the same
    assert [s for s, (packs, mbs) in repacks.items() if as_sets(packs) != as_sets(mbs)], \
        "the LLM's microbatches were the loader's packs in every step"
    for rank in (1, 2):
        assert _fed_by_iteration(whole, rank) == _fed_by_iteration(trainable, rank), rank

    resumed = real_jobs.run("flow_repack_frozen_vit1_pp2_resume", replace(
        base, load=str(whole.workdir / "ckpt"), extra_args=PER_TOKEN + ("--ckpt-step", str(k))))
    assert_finished(resumed, first=k + 1, last=iters)
    assert resumed.exact_losses == {i: v for i, v in whole.exact_losses.items() if i > k}
    assert resumed.consumed == {i: v for i, v in whole.consumed.items() if i > k}
    packs = _fed_by_iteration(whole, 1)  # the LLM's first stage, by iteration
    its = sorted(packs)
    for rank in (1, 2):
        fed = _fed_by_iteration(whole, rank)
        assert _fed_by_iteration(resumed, rank) == {i: fed[i] for i in its[k:]}, rank
    after = _repacks(resumed.output)
    assert {k + s: r for s, r in after.items()} == {s: r for s, r in repacks.items() if s >= k}

    def total(fed: dict) -> Counter:
        return sum((_tags(b) for b in fed.values()), Counter())

    encoded_ahead = _tags(packs[its[k]])  # iteration K + 1's samples (0-based its[k])
    enc_whole, enc_resumed = _fed_by_iteration(whole, 0), _fed_by_iteration(resumed, 0)
    assert _tags(enc_whole[its[k - 1]]) == encoded_ahead  # encoded ahead during iteration K, when it saved
    assert _tags(enc_resumed[its[k]]) == encoded_ahead + _tags(packs[its[k + 1]])  # encoded again, and ahead again
    assert total(enc_whole) == total(packs)  # uninterrupted: every sample the LLM got, encoded once
    assert total(enc_resumed) == total({i: packs[i] for i in its[k:]})  # after the resume, the same


DP2_LAYOUT_FILE = HERE / "flow_repack_dp2_layout.yaml"


def _dealt(output: str) -> dict[int, tuple[list, list]]:
    """Step -> (the loader's packs of both slices, each repacked microbatch's backbone replica): :func:`_logged`'s."""
    return {step: (packs, replicas) for step, (packs, _, replicas) in _logged(output).items()}


@pytest.mark.timeout(1800)
def test_pretrain_vlm_deals_samples_over_two_slices_and_resumes_bit_for_bit(real_jobs):
    """``pretrain_vlm.py`` with ``flow_repack_dp2_layout.yaml`` (two slices: ViT ranks 0, 1,
    two-stage LLMs on ranks 2-3 and 4-5), per-token loss and a frozen ViT, RESUME_ITERS
    iterations, saving at RESUME_K without stopping.  Every rank gathers both slices' packs
    and logs the same repacking and deal over the 2 x 2 stages; in some step a sample one
    slice's loader read is trained by the other slice; in every iteration no sample reaches
    the two first stages twice, each slice's two stages are fed the same microbatches, and
    over the run the two ViT ranks together encode exactly the samples the LLM is fed (once
    each, through the pool both slices share); the ViT ranks run ahead into the next step
    after every step but the last (their gather of the next step is a collective of their
    own), step K + 1's samples encoded during step K.  Resumed from RESUME_K
    (``--ckpt-step``): losses, consumed samples, every LLM rank's fed samples and every
    step's repacking and deal bit for bit as the saving run; the samples encoded ahead at the
    save are encoded again, and after the resume each sample is encoded once."""
    from realjob import RealJob
    from test_real_job import FLOW, PER_TOKEN, assert_finished

    iters, k = RESUME_ITERS, RESUME_K
    base = RealJob(pp=2, world_size=6, iters=iters, extra_args=PER_TOKEN, timeout_s=900, model_patch=FROZEN_VIT,
                   plugin=FLOW + ("--flow-schedule-config", str(DP2_LAYOUT_FILE)))
    whole = real_jobs.run("flow_repack_dp2_frozen_save", replace(base, save="ckpt", save_interval=k))
    assert_finished(whole, last=iters)
    dealt, repacks = _dealt(whole.output), _repacks(whole.output)
    assert sorted(dealt) == sorted(repacks) == list(range(iters)), whole.output[-3000:]
    moved = []
    for step, (packs, replicas) in dealt.items():
        assert len(replicas) == len(packs) and sorted(set(replicas)) == [0, 1], step
        read_by = {s: p * 2 // len(packs) for p, pack in enumerate(packs) for s in pack}  # slice 0's packs first
        trained_by = {s: r for mb, r in zip(repacks[step][1], replicas) for s in mb}
        assert sorted(trained_by) == sorted(read_by), step  # every sample of both slices once
        moved += [(step, s) for s in read_by if trained_by[s] != read_by[s]]
    assert moved, "no sample was trained by another slice than the one that read it"
    ahead = _ran_ahead(whole.output)  # the ViT ranks log the same steps
    assert sorted(ahead) == list(range(iters - 1)), whole.output[-3000:]
    fed = {rank: _fed_by_iteration(whole, rank) for rank in range(6)}
    its = sorted(fed[2])
    assert len(its) == iters and fed[2] == fed[3] and fed[4] == fed[5]  # a slice's stages: the same microbatches

    def both(by_rank: dict, ranks: tuple, i: int) -> Counter:
        return sum((_tags(by_rank[r].get(i, [])) for r in ranks), Counter())

    def total(by_rank: dict, ranks: tuple, steps: list) -> Counter:
        return sum((both(by_rank, ranks, i) for i in steps), Counter())

    for i in its:
        assert not [t for t, n in both(fed, (2, 4), i).items() if n > 1], i  # no sample twice in a step
    assert total(fed, (0, 1), its) == total(fed, (2, 4), its)  # every sample trained, encoded once
    assert both(fed, (0, 1), its[k - 1]) - both(fed, (2, 4), its[k - 1]) == both(fed, (2, 4), its[k])  # ahead at K

    resumed = real_jobs.run("flow_repack_dp2_frozen_resume", replace(
        base, load=str(whole.workdir / "ckpt"), extra_args=PER_TOKEN + ("--ckpt-step", str(k))))
    assert_finished(resumed, first=k + 1, last=iters)
    assert resumed.exact_losses == {i: v for i, v in whole.exact_losses.items() if i > k}
    assert resumed.consumed == {i: v for i, v in whole.consumed.items() if i > k}
    for rank in (2, 3, 4, 5):
        assert _fed_by_iteration(resumed, rank) == {i: fed[rank][i] for i in its[k:]}, rank
    assert {k + s: d for s, d in _dealt(resumed.output).items()} == {s: d for s, d in dealt.items() if s >= k}
    again = {rank: _fed_by_iteration(resumed, rank) for rank in (0, 1)}
    assert both(again, (0, 1), its[k]) - both(fed, (2, 4), its[k + 1]) == both(fed, (2, 4), its[k])  # again
    assert total(again, (0, 1), its[k:]) == total(fed, (2, 4), its[k:])  # after the resume: each encoded once
    assert_no_pool_left(whole.output)
