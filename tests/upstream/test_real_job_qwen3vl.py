"""The Qwen3-VL real job: MindSpeed-MM's own ``pretrain_transformers.py CONFIG.yaml`` (unmodified,
pinned) under torchrun on CPU, as ``examples/qwen3vl/finetune_qwen3vl_*.sh`` start it
(``realjob_transformers.py``: a tiny random Qwen3-VL in HF format with Qwen3-VL's 16-pixel
patches, the recipe's YAML with a CPU run's changes, the ``"huggingface"`` conversation data
path with generated images).  One rank, Megatron DDP (no FSDP2), ``ckpt_format: torch``, or
FSDP2 on 2 gloo ranks (``torch_dcp``); 8 iterations of 4 microbatches.

What is asserted:

- upstream as is finishes with every iteration's loss logged and finite, consumed samples logged
  == the samples the model was fed (tags read back from ``input_ids``), no sample fed twice, and
  every attention call (ViT and LLM) on the varlen TND path of the recipe's
  ``flash_attention_2``;
- ``--use-flowtrain`` runs the plugin's packing loader (by each route: on the command line after
  the YAML through the ``.pth`` hook, in ``MINDSPEED_FLOW_FLAGS``, through
  ``-m mindspeed_flow.launch``), with Megatron's DDP on one rank and with FSDP2 on 2 ranks:
  finite losses, consumed samples == the samples fed, each DP rank's first epoch feeds its shard
  once and the shards are the whole corpus, microbatches hold several samples, every LLM
  attention call is varlen with one segment per sample (no dense mask), and the routes give the
  same samples and losses bit for bit; the feature log names each feature turned off and why;
- ``--use-flowtrain --no-flow-packing --no-flow-conv-matmul`` feeds upstream's samples and gives
  upstream's losses bit for bit (the other features do not change the math);
- save at 4 and resume to 8 with packing, ``torch`` (DDP) and ``torch_dcp`` (FSDP2): losses bit
  for bit the uninterrupted run's, consumed samples and the sample sequence identical (no
  sample twice, none skipped) - where upstream's own dynamic batching fails
  (``../shared/upstream/README.md``);
- packing with a non-varlen ``attn_implementation`` in the YAML: refused at start-up, naming the
  key and value; ``--flow-schedule`` / ``--flow-pool`` asked for by name: refused, naming each
  and why;
- FSDP2 on 2 ranks upstream as is feeds each iteration the samples the 1-rank DDP run fed, losses
  within bf16 noise of it;
- ``use_flowtrain: true`` in the YAML's ``gpt_args`` is not a route: the plugin is not active when
  upstream parses the rebuilt command line, and Megatron refuses the unknown flag.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import replace

import pytest

from mindspeed_flow.adapters.mindspeed_mm.transformers_path import NOT_ON_THIS_PATH
from realjob_run import RealRun
from realjob_transformers import TransformersJob
# the pretrain_vlm.py job's: 8 iterations; finished with finite losses logged exactly; bf16 noise between runs
from test_real_job import BF16_RTOL, ITERS, assert_finished

# A test may start up to three runs (an FSDP2 one ~60-100 s on a quiet machine, minutes on a loaded one).
pytestmark = pytest.mark.timeout(1800)

FLOW = ("--use-flowtrain",)
PACK_CAPACITY = 256  # --seq-length of the packing runs: a pack holds a few samples of the tiny corpus
K = 4  # save / exit at this iteration, resume to ITERS
VAL_RATE = 0.25  # of the 48 samples: 12 held out for validation
PACKED = {"seq_length": PACK_CAPACITY, "iters": ITERS}
FSDP2 = {"dp": 2, "fsdp2": True, "ckpt_format": "torch_dcp"}
JOBS = {
    "q3_up": TransformersJob(iters=ITERS),
    "q3_flow_cli": TransformersJob(plugin=FLOW, **PACKED),
    "q3_flow_env": TransformersJob(extra_env=(("MINDSPEED_FLOW_FLAGS", " ".join(FLOW)),), **PACKED),
    "q3_flow_module": TransformersJob(plugin=FLOW, launch="module", **PACKED),
    # conv_matmul computes the ViT's patch embedding as a matmul (other rounding): off here
    "q3_flow_nopack": TransformersJob(iters=ITERS, plugin=FLOW + ("--no-flow-packing", "--no-flow-conv-matmul")),
    "q3_refused": TransformersJob(iters=ITERS, plugin=("--use-flowtrain", "--flow-schedule", "--flow-pool")),
    "q3_pack_sdpa": TransformersJob(plugin=FLOW, yaml_patch=(("model.text_decoder.attn_implementation", "sdpa"),),
                                    **PACKED),
    "q3_flow_val": TransformersJob(plugin=FLOW, yaml_patch=(("data.dataset_param.basic_parameters.val_rate", VAL_RATE),
                                                            ("gpt_args.eval_interval", K), ("gpt_args.eval_iters", 2)),
                                   **PACKED),
    "q3_yaml_flag": TransformersJob(iters=ITERS, yaml_patch=(("gpt_args.use_flowtrain", True),)),
    "q3_up_fsdp2": TransformersJob(iters=ITERS, **FSDP2),
    "q3_flow_fsdp2": TransformersJob(extra_env=(("MINDSPEED_FLOW_FLAGS", " ".join(FLOW)),), **PACKED, **FSDP2),
}
# Save at K, exit; resume to ITERS: the uninterrupted run each continues.
RESUMES = {"torch": "q3_flow_cli", "torch_dcp": "q3_flow_fsdp2"}
# --use-flowtrain turns these off on this path (the allocator is off without a plan anyway).
TURNED_OFF = sorted(set(NOT_ON_THIS_PATH) - {"allocator"})
# The tiny model's LLM attention: 4 heads of 16 (its ViT: 2 heads of 32).
LLM_HEADS = [4, 16]


def run(real_jobs, name: str) -> RealRun:
    return real_jobs.run(name, JOBS[name])


def per_iteration_samples(run_: RealRun) -> dict[int, list[int]]:
    """{iteration: the sample tags fed in it over every DP rank, sorted}."""
    out: dict[int, list[int]] = {}
    for iteration, _, tags in run_.fed:
        out.setdefault(iteration, []).extend(tags)
    return {i: sorted(tags) for i, tags in out.items()}


def assert_consumed_counts_fed(run: RealRun) -> None:
    """Each iteration's consumed samples (as logged) grew by the samples the model was fed."""
    fed = per_iteration_samples(run)
    previous = 0
    for iteration in sorted(run.consumed):
        assert run.consumed[iteration] - previous == len(fed[iteration]), (iteration, run.consumed, fed)
        previous = run.consumed[iteration]


def assert_consumed_is_fed(run: RealRun) -> None:
    """As :func:`assert_consumed_counts_fed`, and no sample fed twice (the run stays in its first epoch)."""
    assert_consumed_counts_fed(run)
    samples = run.fed_samples()
    assert samples and max(Counter(samples).values()) == 1, samples


def test_upstream_as_is_trains(real_jobs):
    run_ = run(real_jobs, "q3_up")
    assert_finished(run_)
    assert_consumed_is_fed(run_)
    assert run_.consumed[ITERS] == ITERS * JOBS["q3_up"].gbs
    # every attention call, the ViT's and the LLM's, went through the varlen TND kernel
    calls = run_.kernel_attention
    assert calls and all(c["layout"] == "TND" and c["actual_seq_qlen"] for c in calls)


def feature_line(run_: RealRun) -> str:
    """The job's one feature line (the features on, then the notes: each turned off, with why)."""
    lines = [line for line in run_.output.splitlines() if "=> mindspeed-flow: " in line and " off on " in line]
    assert len(lines) == 1, run_.output[-3000:]
    return lines[0]


def assert_names_what_it_turned_off(run_: RealRun) -> None:
    line = feature_line(run_)
    for feature in TURNED_OFF:
        assert f"{feature} off on pretrain_transformers.py (on under --use-flowtrain): " \
               f"{NOT_ON_THIS_PATH[feature]}" in line


def assert_packs_every_sample_once(run_: RealRun) -> None:
    """Packs of several samples; each DP rank's first epoch is its shard, every sample once,
    and the shards together are the corpus (ranks may start their next epoch a few packs apart)."""
    batches = [b for b in run_.batches if b["training"]]
    assert max(len(b["rows"][0][0]["tags"]) for b in batches) > 1
    assert len(run_.fed_samples()) > ITERS * run_.job.gbs
    streams: dict[int, list[int]] = {}
    for _, dp, tags in run_.fed:
        streams.setdefault(dp, []).extend(tags)
    share = run_.job.samples // run_.job.dp
    firsts = [t for stream in streams.values() for t in stream[:share]]
    assert sorted(firsts) == list(range(run_.job.samples)), streams


def assert_llm_attention_is_per_sample(run_: RealRun) -> None:
    """Every LLM attention call is varlen TND over the whole pack, its segments the pack's
    samples: as many as a fed microbatch held, never one dense span over several samples."""
    llm = [c for c in run_.kernel_attention if c["query"][1:] == LLM_HEADS]
    assert llm and all(c["layout"] == "TND" and c["sparse_mode"] == 3 for c in llm)  # causal within each segment
    assert all(c["actual_seq_qlen"][-1] == c["query"][0] and c["actual_seq_qlen"] == sorted(set(c["actual_seq_qlen"]))
               for c in llm)
    samples_per_batch = {len(b["rows"][0][0]["tags"]) for b in run_.batches}
    assert {len(c["actual_seq_qlen"]) for c in llm} <= samples_per_batch
    assert max(len(c["actual_seq_qlen"]) for c in llm) > 1


@pytest.mark.parametrize("name", ["q3_flow_cli", "q3_flow_fsdp2"])
def test_flowtrain_packs_with_the_plugins_loader(real_jobs, name):
    ours = run(real_jobs, name)
    assert_finished(ours)
    assert_consumed_counts_fed(ours)  # packs go through the corpus more than once in 8 iterations
    assert_packs_every_sample_once(ours)
    assert_llm_attention_is_per_sample(ours)
    assert_names_what_it_turned_off(ours)
    assert "packing" in feature_line(ours).split("=> mindspeed-flow: ")[1].split(";")[0]
    if ours.job.fsdp2:
        assert {dp for _, dp, _ in ours.fed} == {0, 1}


@pytest.mark.parametrize("name", ["q3_flow_env", "q3_flow_module"])
def test_every_route_packs_the_same(real_jobs, name):
    ours, cli = run(real_jobs, name), run(real_jobs, "q3_flow_cli")
    assert_finished(ours)
    assert ours.fed == cli.fed and ours.consumed == cli.consumed
    assert ours.exact_losses == cli.exact_losses


def test_flowtrain_without_packing_gives_upstreams_losses(real_jobs):
    ours, upstream = run(real_jobs, "q3_flow_nopack"), run(real_jobs, "q3_up")
    assert_finished(ours)
    assert_consumed_is_fed(ours)
    assert ours.fed == upstream.fed  # MindSpeed-MM's own data path
    assert ours.exact_losses == upstream.exact_losses  # nothing else changes the math
    assert_names_what_it_turned_off(ours)


def saved(real_jobs, fmt: str) -> RealRun:
    job = replace(JOBS[RESUMES[fmt]], save="ckpt", save_interval=K, exit_interval=K)
    return real_jobs.run(f"q3_pack_{fmt}_save", job)


def resumed(real_jobs, fmt: str) -> RealRun:
    first = saved(real_jobs, fmt)
    return real_jobs.run(f"q3_pack_{fmt}_resume", replace(JOBS[RESUMES[fmt]], load=str(first.workdir / "ckpt")))


@pytest.mark.parametrize("fmt", list(RESUMES))
def test_packing_resumes_bit_for_bit(real_jobs, fmt):
    whole, first, second = run(real_jobs, RESUMES[fmt]), saved(real_jobs, fmt), resumed(real_jobs, fmt)
    assert_finished(first, 1, K)
    assert_finished(second, K + 1, ITERS)
    assert {**first.exact_losses, **second.exact_losses} == whole.exact_losses
    assert {**first.consumed, **second.consumed} == whole.consumed
    assert first.fed + second.fed == whole.fed  # no sample twice, none skipped, same order, same DP rank
    assert list((first.workdir / "ckpt").rglob("flow_loader_dprank*.pt"))  # the loader state beside it


def test_packing_honours_the_validation_split(real_jobs):
    """``val_rate`` holds out MindSpeed-MM's records (``datasets``' ``train_test_split`` with the
    YAML's seed): never trained on, every one evaluated, validation loss logged at each interval."""
    from mindspeed_flow.adapters.mindspeed_mm.data import held_out_split

    ours = run(real_jobs, "q3_flow_val")
    assert_finished(ours)
    assert_consumed_counts_fed(ours)
    _, held = held_out_split(ours.job.samples, VAL_RATE, seed=42)  # the recipe's gpt_args.seed
    assert len(held) == 12
    assert {t for _, _, tags in ours.evaluated for t in tags} == set(held)
    assert set(ours.fed_samples()) == set(range(ours.job.samples)) - set(held)
    values = [float(v) for line in ours.validation for v in re.findall(r"loss value: ([0-9.E+-]+)", line)]
    assert len(ours.validation) >= 2 and values and all(math.isfinite(v) for v in values), ours.validation


def test_schedule_and_pool_asked_for_by_name_are_refused_at_start_up(real_jobs):
    refused = real_jobs.run("q3_refused", JOBS["q3_refused"], check=False)
    assert refused.returncode != 0 and not refused.losses
    lines = [line for line in refused.output.splitlines() if "mindspeed-flow: refusing to start: " in line]
    assert lines, refused.output[-3000:]
    for feature in ("pool", "schedule"):
        assert f"{feature} ({NOT_ON_THIS_PATH[feature]})" in lines[0]
    assert "Traceback" not in refused.output.split("mindspeed-flow: refusing to start: ")[0]


def test_packing_with_a_dense_attention_is_refused_naming_the_yaml_key(real_jobs):
    refused = real_jobs.run("q3_pack_sdpa", JOBS["q3_pack_sdpa"], check=False)
    assert refused.returncode != 0 and not refused.losses
    lines = [line for line in refused.output.splitlines() if "mindspeed-flow: refusing to start: " in line]
    assert lines, refused.output[-3000:]
    assert "model.text_decoder.attn_implementation is 'sdpa'" in lines[0] and "--no-flow-packing" in lines[0]


def test_use_flowtrain_in_the_yaml_is_not_a_route(real_jobs):
    """The YAML reader writes ``--use-flowtrain`` into the rebuilt command line after the plugin's
    activation point: the plugin never starts, and Megatron refuses the flag (nothing silent)."""
    run_ = real_jobs.run("q3_yaml_flag", JOBS["q3_yaml_flag"], check=False)
    assert run_.returncode != 0 and not run_.losses
    assert "error: unrecognized arguments: --use-flowtrain" in run_.output


def test_fsdp2_on_two_ranks_trains_what_one_ddp_rank_trains(real_jobs):
    fsdp2, ddp = run(real_jobs, "q3_up_fsdp2"), run(real_jobs, "q3_up")
    assert_finished(fsdp2)
    assert_consumed_is_fed(fsdp2)
    assert {dp for _, dp, _ in fsdp2.fed} == {0, 1}
    assert per_iteration_samples(fsdp2) == per_iteration_samples(ddp)
    for i, loss in ddp.exact_losses.items():
        assert math.isclose(fsdp2.exact_losses[i], loss, rel_tol=BF16_RTOL), (i, fsdp2.exact_losses, ddp.exact_losses)
    assert any("base_model DeviceMesh / init_device_mesh: device 'npu' -> 'cpu'" in shim for shim in fsdp2.shims)
