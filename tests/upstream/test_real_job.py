"""The real job: MindSpeed-MM's own ``pretrain_vlm.py`` (unmodified, pinned) under torchrun, as
users start it, with and without the plugin (``realjob.py``; what is stood in / shimmed is
printed at the end of the session).

Every run is at least 8 iterations and runs once per session (``real_jobs`` shares them by
name).  What is asserted:

- each run finishes with rc 0 and logs every iteration's loss; consumed samples logged == the
  samples the model was fed (tags read back from ``input_ids``);
- upstream as is at PP=1, PP=2 (2 gloo ranks) and DP=2 (distributed optimizer) feeds each sample
  of an epoch once, the same samples at PP=1 and PP=2;
- ``--use-flowtrain`` at PP=1 (``.pth`` hook) and DP=2 (``-m mindspeed_flow.launch``,
  distributed optimizer, ``--calculate-per-token-loss``) and TP=2 without sequence parallelism:
  packs, no attention call crosses a sample boundary, the loss curve tracks upstream's, and the
  packed loss of step 1 equals the same samples' unpacked loss (upstream's collator and model);
- each feature flag alone at PP=1: the non-packing ones feed upstream's samples and stay within
  bf16 noise of upstream's losses;
- save at k and resume (``--save-interval k --exit-interval k``, then ``--load``), with and
  without the plugin, ``--ckpt-format torch`` and ``torch_dist``: the resumed run continues bit
  for bit, no sample fed twice, none skipped; a ``torch_dist`` checkpoint of upstream resumes
  with the plugin;
- evaluation without a validation split (``--eval-interval``) runs and evaluates nothing.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

import pytest

from realjob import RealJob
from realjob_run import RealRun

ITERS = 8
K = 4  # save / exit at this iteration, resume to ITERS
FLOW = ("--use-flowtrain",)
PER_TOKEN = ("--calculate-per-token-loss",)
DIST_OPT = ("--use-distributed-optimizer",)
# Losses of runs that feed the same samples through different kernels (bf16 parameters and
# activations): relative difference per iteration.
BF16_RTOL = 1e-3
# Feature flags that act alone at PP=1 without changing which samples are fed (the packing
# loader is the only one that changes the data).
SAME_SAMPLE_FLAGS = ("--flow-schedule", "--flow-pool", "--flow-fused-attn", "--flow-conv-matmul",
                     "--flow-recipes", "--flow-system")

JOBS = {
    "up_pp1": RealJob(eval_interval=K),
    "up_pp2": RealJob(pp=2),
    "up_dp2": RealJob(dp=2, extra_args=DIST_OPT),
    "flow_pp1": RealJob(plugin=FLOW, eval_interval=K),
    "flow_dp2": RealJob(dp=2, plugin=FLOW, launch="module", extra_args=DIST_OPT + PER_TOKEN),
    "flow_tp2": RealJob(tp=2, plugin=FLOW),
    "pack_pp1": RealJob(plugin=("--flow-packing",)),
    **{f"flag_{flag[7:].replace('-', '_')}": RealJob(plugin=(flag,)) for flag in SAME_SAMPLE_FLAGS},
}
# Save at K, exit; resume to ITERS.  (base job, format)
RESUMES = {
    "up_torch": (JOBS["up_pp1"], "torch"),
    "up_dist": (JOBS["up_pp1"], "torch_dist"),
    "flow_torch": (JOBS["flow_pp1"], "torch"),
    "flow_dist": (JOBS["flow_pp1"], "torch_dist"),
}


def run(real_jobs, name: str) -> RealRun:
    return real_jobs.run(name, JOBS[name])


def saved(real_jobs, name: str) -> RealRun:
    base, fmt = RESUMES[name]
    job = replace(base, ckpt_format=fmt, save="ckpt", save_interval=K, exit_interval=K)
    return real_jobs.run(f"{name}_save", job)


def resumed(real_jobs, name: str) -> RealRun:
    base, fmt = RESUMES[name]
    first = saved(real_jobs, name)
    job = replace(base, ckpt_format=fmt, load=str(first.workdir / "ckpt"))
    return real_jobs.run(f"{name}_resume", job)


def per_iteration_fed(run: RealRun) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for iteration, _, tags in run.fed:
        out.setdefault(iteration, []).extend(tags)
    return out


def assert_finished(run: RealRun, first: int = 1, last: int = ITERS) -> None:
    assert run.returncode == 0
    assert sorted(run.losses) == list(range(first, last + 1)), run.output[-3000:]
    assert all(math.isfinite(v) for v in run.losses.values())
    assert sorted(run.exact_losses) == list(range(first, last + 1))
    for i, loss in run.exact_losses.items():  # the log prints what the step returned
        assert float(f"{loss:.6E}") == run.losses[i]


def assert_consumed_is_fed(run: RealRun, start: int = 0) -> None:
    fed = per_iteration_fed(run)
    previous = start
    for iteration in sorted(run.consumed):
        assert run.consumed[iteration] - previous == len(fed[iteration]), (iteration, run.consumed, fed)
        previous = run.consumed[iteration]


def assert_no_attention_crosses(run: RealRun, packed: bool) -> None:
    """Every training batch a rank's model got went through each of that rank's LLM layers'
    core attention once, and no call let a query see a key of another sample."""
    calls, batches = defaultdict(int), defaultdict(int)
    for a in run.attention:
        calls[a["rank"]] += a["training"]
    for b in run.batches:
        batches[b["rank"]] += b["training"]
    stages = run.job.model_json()["text_decoder"]["pipeline_num_layers"]
    for rank, n in batches.items():
        pp_rank = next(b["pp"] for b in run.batches if b["rank"] == rank)
        assert calls[rank] == stages[pp_rank] * n, (rank, calls, batches)
    assert sum(calls.values()) > 0
    crossing = [a for a in run.attention if a["crosses"]]
    assert not crossing, crossing[:3]
    if packed:
        multi = [a for a in run.attention if any(n > 1 for n in a["samples_in_row"])]
        assert multi  # really packed
        assert all(a["packed"] for a in multi)  # and given their segments


def close(a: float, b: float, rtol: float = BF16_RTOL) -> bool:
    return abs(a - b) <= rtol * abs(b)


# ------------------------------------------------------------------------- upstream as is

@pytest.mark.parametrize("name", ["up_pp1", "up_pp2", "up_dp2"])
def test_upstream_as_is(real_jobs, name):
    r = run(real_jobs, name)
    assert_finished(r)
    assert_consumed_is_fed(r)
    assert r.consumed[ITERS] == ITERS * r.job.gbs
    fed = r.fed_samples()
    assert len(fed) == len(set(fed)) == ITERS * r.job.gbs  # within one epoch of 48: each sample once
    assert not r.evaluated and not r.validation  # no validation split: nothing evaluated
    assert "mindspeed-flow:" not in r.output and "[mindspeed_flow." not in r.output  # no plugin without its flags
    assert_no_attention_crosses(r, packed=False)


def test_upstream_pp2_feeds_what_pp1_feeds(real_jobs):
    assert run(real_jobs, "up_pp2").fed == run(real_jobs, "up_pp1").fed


def test_upstream_stand_ins_are_named(real_jobs):
    r = run(real_jobs, "up_pp1")
    assert {"npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"} <= set(r.stood_in["torch_npu"])
    assert "torchvision" in r.stood_in["torchvision"]
    shims = " ".join(r.shims)
    for name in ("compile_helpers", "Tensor.type()", "torch_npu.profiler", "torch.npu.config", "bf16 matrix products"):
        assert name in shims
    assert r.kernel_attention  # MindSpeed's --use-flash-attn path: the stand-in kernel ran


# ------------------------------------------------------------------------- with the plugin

@pytest.mark.parametrize("name", ["flow_pp1", "flow_dp2", "flow_tp2", "pack_pp1"])
def test_plugin_packs_and_accounts(real_jobs, name):
    r = run(real_jobs, name)
    assert_finished(r)
    assert "mindspeed-flow: " in r.output
    assert_consumed_is_fed(r)
    fed = per_iteration_fed(r)
    assert sum(map(len, fed.values())) > ITERS * r.job.gbs  # more than one sample per microbatch
    # the first epoch feeds every sample once: each DP rank's first samples/dp are distinct and
    # together they are the whole corpus (ranks may start their next epoch a few packs apart)
    streams: dict[int, list[int]] = defaultdict(list)
    for _, dp, tags in r.fed:
        streams[dp].extend(tags)
    share = r.job.samples // r.job.dp
    firsts = [t for stream in streams.values() for t in stream[:share]]
    assert sorted(firsts) == list(range(r.job.samples))
    assert_no_attention_crosses(r, packed=True)


def test_flowtrain_launch_module_equals_pth(real_jobs):
    """Both launch paths turn the same plugin on: DP=2 through ``-m mindspeed_flow.launch``
    reports the same features as PP=1 through the ``.pth`` hook."""
    line = "mindspeed-flow: packing"
    pth, module = run(real_jobs, "flow_pp1"), run(real_jobs, "flow_dp2")
    assert line in pth.output and line in module.output
    assert "mindspeed_flow.launch" in module.command and "mindspeed_flow.launch" not in pth.command


@pytest.mark.parametrize("name", ["flow_pp1", "pack_pp1"])
def test_packed_loss_curve_tracks_upstream(real_jobs, name):
    up, ours = run(real_jobs, "up_pp1"), run(real_jobs, name)
    assert close(ours.exact_losses[1], up.exact_losses[1], 0.01)  # same initial weights, other samples
    for i in range(2, ITERS + 1):  # it learns at least as fast per step and never blows up
        assert ours.exact_losses[i] <= up.exact_losses[i] * 1.02, (i, ours.losses, up.losses)
    assert ours.exact_losses[ITERS] < ours.exact_losses[1]


def test_packed_step_equals_the_same_samples_unpacked(real_jobs):
    """Step 1 of the plugin's DP=2 run (packed, per-token loss over both replicas) against
    upstream's collator and model fed exactly those samples one per microbatch."""
    ours = run(real_jobs, "flow_dp2")
    step1 = per_iteration_fed(ours)[1]
    corpus = Path(json.loads((ours.workdir / "data.json").read_text())
                  ["dataset_param"]["basic_parameters"]["dataset"])
    records = json.loads(corpus.read_text())
    chosen = [records[t] for t in step1]  # tag == index in the corpus
    subset = corpus.parent / f"step1_{'_'.join(map(str, step1))[:60]}.json"  # beside it: same image folder
    subset.write_text(json.dumps(chosen))
    job = RealJob(gbs=len(chosen), extra_args=PER_TOKEN, data_patch=(
        ("dataset_param.basic_parameters.dataset", str(subset)), ("dataloader_param.shuffle", False)))
    up = real_jobs.run("up_same_as_flow_dp2_step1", job)
    assert_finished(up)
    assert sorted(per_iteration_fed(up)[1]) == sorted(step1)
    assert close(ours.exact_losses[1], up.exact_losses[1], 1e-5), (ours.exact_losses[1], up.exact_losses[1])  # measured 8e-8


# ------------------------------------------------------------------------- flags alone

@pytest.mark.parametrize("flag", SAME_SAMPLE_FLAGS)
def test_flag_alone_feeds_upstream_samples_within_bf16_noise(real_jobs, flag):
    r = run(real_jobs, f"flag_{flag[7:].replace('-', '_')}")
    up = run(real_jobs, "up_pp1")
    assert_finished(r)
    assert r.fed == up.fed
    assert r.consumed == up.consumed
    for i in range(1, ITERS + 1):
        assert close(r.exact_losses[i], up.exact_losses[i]), (flag, i, r.exact_losses, up.exact_losses)


def test_allocator_alone_asks_for_a_plan(real_jobs):
    """``--flow-allocator`` alone has nothing to apply: start-up refuses, naming the flag to add."""
    r = real_jobs.run("flag_allocator", RealJob(plugin=("--flow-allocator",)), check=False)
    assert r.returncode != 0
    assert "--flow-allocator is on but no plan was given: add --flow-allocator-plan" in r.output
    assert not r.losses


# ------------------------------------------------------------------------- save / resume

@pytest.mark.parametrize("name", list(RESUMES))
def test_resume_continues_bit_for_bit(real_jobs, name):
    base_name = "up_pp1" if name.startswith("up") else "flow_pp1"
    whole, first, second = run(real_jobs, base_name), saved(real_jobs, name), resumed(real_jobs, name)
    assert_finished(first, 1, K)
    assert_finished(second, K + 1, ITERS)
    assert {**first.exact_losses, **second.exact_losses} == whole.exact_losses
    assert {**first.consumed, **second.consumed} == whole.consumed
    assert_consumed_is_fed(second, start=first.consumed[K])
    fed = first.fed + second.fed
    assert fed == whole.fed  # no sample twice, none skipped, same order, same DP rank
    if name.startswith("up"):
        samples = [t for _, _, tags in fed for t in tags]
        assert len(samples) == len(set(samples))


def test_torch_dist_checkpoint_of_upstream_resumes_with_the_plugin(real_jobs):
    first = saved(real_jobs, "up_dist")
    job = replace(JOBS["flow_pp1"], ckpt_format="torch_dist", load=str(first.workdir / "ckpt"))
    r = real_jobs.run("up_dist_resume_flow", job)
    assert_finished(r, K + 1, ITERS)
    assert r.consumed[K + 1] > first.consumed[K]
    # the model state came from upstream's checkpoint: the first resumed loss is near upstream's own
    assert close(r.exact_losses[K + 1], resumed(real_jobs, "up_dist").exact_losses[K + 1], 0.01)


# ------------------------------------------------------------------------- evaluation

@pytest.mark.parametrize("name", ["up_pp1", "flow_pp1"])
def test_evaluation_without_a_validation_split(real_jobs, name):
    r = run(real_jobs, name)
    assert r.job.eval_interval == K
    assert_finished(r)
    assert not r.evaluated  # nothing to evaluate, and no crash at the eval interval


def test_job_table():
    """Every run is at least 8 iterations; no two names for one job."""
    assert all(job.iters >= 8 for job in JOBS.values())
    assert Counter(JOBS.values()).most_common(1)[0][1] == 1
