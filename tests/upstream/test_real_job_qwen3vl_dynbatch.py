"""MindSpeed-MM's own packing on the Qwen3-VL path, and the UPSTREAM DEFECT in its resume that the
plugin's packing loader fixes (issue 25).

``pretrain_transformers.py CONFIG.yaml`` (pinned, unmodified; ``realjob_transformers.py``: tiny
random Qwen3-VL, the recipe's YAML with a CPU run's changes) with upstream's text dynamic batching
switched on in the YAML (``use_txt_dynamic_batching``, ``max_seq_len``,
``dynamic_batch_buffer_size``): ``DynamicBatchingDataLoader`` takes samples from the sampler-driven
loader into a buffer and hands out packs ``[1, S]`` with ``seqlens`` / ``indices``.

Asserted:

- it trains 8 iterations with finite losses, with Megatron's DDP on one rank and with FSDP2 on 2
  gloo ranks (the recipe's ``fsdp2_config.yaml``); every microbatch is a pack ``[1, S]``, packs
  of several samples among them; the consumed samples Megatron logs are the samples fed
  (``training.train`` all-gathers the loaders' counts over the data-parallel group), and each
  rank's first epoch feeds its shard once;
- **upstream defect 1**: saved at iteration 4 and resumed, the run crashes before its first step.
  ``training.train`` adds the all-gathered count as a tensor, so ``consumed_train_samples`` is
  checkpointed as a tensor; on load it reaches ``BaseRandomBatchSampler`` whose
  ``torch.Generator.manual_seed`` refuses it (``manual_seed expected a long, but got Tensor``);
- **upstream defect 2**: with that value turned back into an int in the checkpoint (what a user
  would patch first), the resumed run trains, but not on the uninterrupted run's data: the
  batcher's buffer is not checkpointed and the sampler restarts at the consumed count in its own
  order, while the packs had taken samples out of that order.  Within the first epoch the
  interrupted run feeds samples twice (once before the checkpoint, once after) and never feeds
  as many others, read from the fed ``input_ids`` (measured: consumed 38 at iteration 4, sample
  11 fed twice, sample 45 never).

The plugin's packing (``--use-flowtrain`` on this path) saves its loader state with the
checkpoint and resumes bit for bit; its tests live beside its loader.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

from pinned_upstream import upstream_sources
from realjob import STANDINS
from realjob_run import RealRun
from realjob_transformers import TransformersJob
from test_real_job import ITERS, assert_finished
from test_real_job_qwen3vl import FSDP2, assert_consumed_counts_fed, assert_packs_every_sample_once

SAVE_AT = 4
SAMPLES = 48  # TransformersJob's corpus: one epoch
BUFFER = 16  # samples the batcher holds to pick a pack from
DYNAMIC_BATCHING = (("gpt_args.use_txt_dynamic_batching", True), ("gpt_args.max_seq_len", 192),
                    ("gpt_args.dynamic_batch_buffer_size", BUFFER))
# Checkpoint paths relative to each run's folder (RealJobs runs every job in root/<name>).
JOBS = {
    "q3_dyn": TransformersJob(iters=ITERS, yaml_patch=DYNAMIC_BATCHING + (
        ("gpt_args.save", "ckpt"), ("gpt_args.save_interval", SAVE_AT))),
    "q3_dyn_resume": TransformersJob(iters=ITERS, yaml_patch=DYNAMIC_BATCHING + (
        ("gpt_args.load", "../q3_dyn/ckpt"), ("gpt_args.ckpt_step", SAVE_AT))),
    "q3_dyn_resume_int": TransformersJob(iters=ITERS, yaml_patch=DYNAMIC_BATCHING + (
        ("gpt_args.load", "ckpt_int"), ("gpt_args.ckpt_step", SAVE_AT))),
    "q3_dyn_fsdp2": TransformersJob(iters=ITERS, yaml_patch=DYNAMIC_BATCHING, **FSDP2),
}
CRASH = "RuntimeError: manual_seed expected a long, but got Tensor"
# Rewrites consumed_train_samples of a Megatron `torch` checkpoint as an int (run with Megatron on the path).
COERCE = """import sys, torch
path = sys.argv[1]
ckpt = torch.load(path, weights_only=False)
value = ckpt["args"].consumed_train_samples
assert torch.is_tensor(value), type(value)
ckpt["args"].consumed_train_samples = int(value)
torch.save(ckpt, path)
print(f"consumed_train_samples {value!r} -> {int(value)}")
"""


def run(real_jobs, name: str, check: bool = True) -> RealRun:
    return real_jobs.run(name, JOBS[name], check=check)


def fed_per_iteration(run_: RealRun) -> dict[int, list[int]]:
    return {iteration: tags for iteration, _, tags in run_.fed}


def checkpoint_with_int_consumed(real_jobs, full: RealRun) -> None:
    """A copy of ``full``'s iteration-4 checkpoint with ``consumed_train_samples`` an int,
    where ``q3_dyn_resume_int`` loads it (before that job runs)."""
    source = full.workdir / "ckpt"
    target = real_jobs.root / "q3_dyn_resume_int" / "ckpt_int"
    if target.exists():
        return
    shutil.copytree(source, target)
    (target / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    model_file = target / f"iter_{SAVE_AT:07d}" / "mp_rank_00" / "model_optim_rng.pt"
    sources = upstream_sources()  # Megatron's copy (its classes are pickled) and what it imports
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (STANDINS, sources.mindspeed_mm, sources.mindspeed)))}
    done = subprocess.run([sys.executable, "-c", COERCE, str(model_file)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def one_sample_packs(run_: RealRun) -> list[tuple[int, int]]:
    """(DP rank, samples that rank had fed through the pack) for each training pack of one sample."""
    fed_so_far: Counter = Counter()
    singles = []
    for batch in sorted((b for b in run_.batches if b["training"]), key=lambda b: (b["dp"], b["iteration"])):
        tags = batch["rows"][0][0]["tags"]
        fed_so_far[batch["dp"]] += len(tags)
        if len(tags) == 1:
            singles.append((batch["dp"], fed_so_far[batch["dp"]]))
    return singles


def assert_trains_packs_and_counts(run_: RealRun) -> None:
    """8 iterations with finite losses; every microbatch one pack ``[1, S]`` of several samples,
    but for a rank's last packs of its first epoch: when its sampler runs dry the batcher flushes
    its buffer (``drop_last`` False), and those packs may hold one sample; the logged consumed
    samples grown by the samples fed over the DP ranks; each DP rank's first epoch feeds its shard
    once and the shards together are the corpus."""
    assert_finished(run_)
    assert sorted({iteration for iteration, _, _ in run_.fed}) == list(range(1, ITERS + 1))
    assert all(b["shape"][0] == 1 and len(b["rows"]) == 1 for b in run_.batches if b["training"])
    share = SAMPLES // run_.job.dp
    assert all(share - BUFFER < through <= share for _, through in one_sample_packs(run_)), one_sample_packs(run_)
    assert_consumed_counts_fed(run_)
    assert_packs_every_sample_once(run_)


def test_upstream_dynamic_batching_trains_packs_and_counts_what_it_fed(real_jobs):
    run_ = run(real_jobs, "q3_dyn")
    assert_trains_packs_and_counts(run_)
    # the premise of the resume below: the checkpoint falls inside an epoch, the buffer holds samples
    assert 0 < run_.consumed[SAVE_AT] < SAMPLES


def test_upstream_resume_crashes_on_its_tensor_consumed_samples(real_jobs):
    """Upstream defect 1 (module docstring)."""
    run(real_jobs, "q3_dyn")
    resumed = run(real_jobs, "q3_dyn_resume", check=False)
    assert resumed.returncode != 0
    assert f"successfully loaded checkpoint from ../q3_dyn/ckpt [ t 1/1, p 1/1 ] at iteration {SAVE_AT}" \
        in resumed.output
    assert CRASH in resumed.output and "sampler.py" in resumed.output
    assert not resumed.losses and not resumed.fed


def test_upstream_resume_with_int_consumed_samples_feeds_samples_twice_and_skips_others(real_jobs):
    """Upstream defect 2 (module docstring): the resumed run's first epoch against the
    uninterrupted one's."""
    full = run(real_jobs, "q3_dyn")
    checkpoint_with_int_consumed(real_jobs, full)
    resumed = run(real_jobs, "q3_dyn_resume_int")
    assert sorted(resumed.losses) == list(range(SAVE_AT + 1, ITERS + 1))
    assert all(math.isfinite(loss) for loss in resumed.losses.values())
    before = [t for i, tags in sorted(fed_per_iteration(full).items()) if i <= SAVE_AT for t in tags]
    after = resumed.fed_samples()
    interrupted = (before + after)[:SAMPLES]
    twice = sorted(t for t, n in Counter(interrupted).items() if n > 1)
    never = sorted(set(range(SAMPLES)) - set(interrupted))
    print(f"upstream dynamic batching resumed at {SAVE_AT} (consumed {full.consumed[SAVE_AT]}): in the first "
          f"{SAMPLES} samples fed, twice: {twice}, never: {never}")
    assert twice and len(twice) == len(never)  # as many fed twice as never fed: the count itself is right
    resumed_part = interrupted[len(before):]
    for sample in twice:  # once before the checkpoint, once more after the resume
        assert (before.count(sample), resumed_part.count(sample)) == (1, 1), (sample, before, resumed_part)
    assert all(sample not in before for sample in never)
    # the data after the resume is not the uninterrupted run's
    uninterrupted_after = [t for i, tags in sorted(fed_per_iteration(full).items()) if i > SAVE_AT for t in tags]
    assert after != uninterrupted_after


def test_upstream_dynamic_batching_under_fsdp2_on_two_ranks(real_jobs):
    """The same dynamic batching with FSDP2 on 2 gloo ranks: it runs as without FSDP2, each rank
    packing from its own shard of the sampler (``DynamicBatchingDataLoader`` wraps each rank's
    loader; ``training.train`` all-gathers the ranks' counts over the data-parallel group)."""
    run_ = run(real_jobs, "q3_dyn_fsdp2")
    assert_trains_packs_and_counts(run_)
    assert {dp for _, dp, _ in run_.fed} == {0, 1}
    assert any("base_model DeviceMesh / init_device_mesh: device 'npu' -> 'cpu'" in shim for shim in run_.shims)
