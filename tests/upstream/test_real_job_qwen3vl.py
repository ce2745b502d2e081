"""The Qwen3-VL real job: MindSpeed-MM's own ``pretrain_transformers.py CONFIG.yaml`` (unmodified,
pinned) under torchrun on CPU, as ``examples/qwen3vl/finetune_qwen3vl_*.sh`` start it
(``realjob_transformers.py``: a tiny random Qwen3-VL in HF format with Qwen3-VL's 16-pixel
patches, the recipe's YAML with a CPU run's changes, the ``"huggingface"`` conversation data
path with generated images).  One rank, Megatron DDP (no FSDP2), ``ckpt_format: torch``, 8
iterations of 4 microbatches.

What is asserted:

- upstream as is finishes with every iteration's loss logged and finite, consumed samples logged
  == the samples the model was fed (tags read back from ``input_ids``), no sample fed twice, and
  every attention call (ViT and LLM) on the varlen TND path of the recipe's
  ``flash_attention_2``;
- ``--use-flowtrain`` by each route (on the command line after the YAML through the ``.pth`` hook,
  in ``MINDSPEED_FLOW_FLAGS``, through ``-m mindspeed_flow.launch``) runs the 8 iterations with
  the features that act on this path (recipes, system), feeds upstream's samples and gives
  upstream's losses bit for bit, and its feature log names every feature it turned off and why
  (``adapters/mindspeed_mm/transformers_path.py``); before, the command-line route stopped at
  start-up (upstream's YAML reader drops the flags: Megatron's namespace disagreed with the plugin's)
  and the environment route crashed in step 1 (the plugin's packs cut at 14-pixel patches);
- ``--flow-packing`` / ``--flow-schedule`` asked for by name: refused at start-up, naming each and why;
- FSDP2 on 2 gloo ranks (the recipe's ``fsdp2_config.yaml``, ``torch_dcp``), upstream as is and with
  ``MINDSPEED_FLOW_FLAGS=--use-flowtrain`` (issue 25's crash): 8 iterations, each iteration feeds the
  samples the 1-rank DDP run fed, losses within bf16 noise of it; the plugin's run gives upstream's
  FSDP2 losses bit for bit;
- ``use_flowtrain: true`` in the YAML's ``gpt_args`` is not a route: the plugin is not active when
  upstream parses the rebuilt command line, and Megatron refuses the unknown flag.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from mindspeed_flow.adapters.mindspeed_mm.transformers_path import NOT_ON_THIS_PATH
from realjob_run import RealRun
from realjob_transformers import TransformersJob
# the pretrain_vlm.py job's: 8 iterations; finished with finite losses logged exactly; bf16 noise between runs
from test_real_job import BF16_RTOL, ITERS, assert_finished

FLOW = ("--use-flowtrain",)
JOBS = {
    "q3_up": TransformersJob(iters=ITERS),
    "q3_flow_cli": TransformersJob(iters=ITERS, plugin=FLOW),
    "q3_flow_env": TransformersJob(iters=ITERS, extra_env=(("MINDSPEED_FLOW_FLAGS", " ".join(FLOW)),)),
    "q3_flow_module": TransformersJob(iters=ITERS, plugin=FLOW, launch="module"),
    "q3_refused": TransformersJob(iters=ITERS, plugin=("--use-flowtrain", "--flow-packing", "--flow-schedule")),
    "q3_yaml_flag": TransformersJob(iters=ITERS, yaml_patch=(("gpt_args.use_flowtrain", True),)),
    "q3_up_fsdp2": TransformersJob(iters=ITERS, dp=2, fsdp2=True, ckpt_format="torch_dcp"),
    "q3_flow_fsdp2": TransformersJob(iters=ITERS, dp=2, fsdp2=True, ckpt_format="torch_dcp",
                                     extra_env=(("MINDSPEED_FLOW_FLAGS", " ".join(FLOW)),)),
}
# --use-flowtrain turns these off on this path (the allocator is off without a plan anyway).
TURNED_OFF = sorted(set(NOT_ON_THIS_PATH) - {"allocator"})


def run(real_jobs, name: str) -> RealRun:
    return real_jobs.run(name, JOBS[name])


def per_iteration_samples(run_: RealRun) -> dict[int, list[int]]:
    """{iteration: the sample tags fed in it over every DP rank, sorted}."""
    out: dict[int, list[int]] = {}
    for iteration, _, tags in run_.fed:
        out.setdefault(iteration, []).extend(tags)
    return {i: sorted(tags) for i, tags in out.items()}


def assert_consumed_is_fed(run: RealRun) -> None:
    fed = per_iteration_samples(run)
    previous = 0
    for iteration in sorted(run.consumed):
        assert run.consumed[iteration] - previous == len(fed[iteration]), (iteration, run.consumed, fed)
        previous = run.consumed[iteration]
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


@pytest.mark.parametrize("name", ["q3_flow_cli", "q3_flow_env", "q3_flow_module", "q3_flow_fsdp2"])
def test_flowtrain_runs_what_acts_here_and_names_what_it_turned_off(real_jobs, name):
    ours = run(real_jobs, name)
    upstream = run(real_jobs, "q3_up_fsdp2" if ours.job.fsdp2 else "q3_up")
    assert_finished(ours)
    assert_consumed_is_fed(ours)
    # packing off: MindSpeed-MM's own data path feeds upstream's samples; nothing else changes the math
    assert ours.fed == upstream.fed
    assert ours.exact_losses == upstream.exact_losses
    features = [line for line in ours.output.splitlines() if "=> mindspeed-flow: recipes, system; " in line]
    assert len(features) == 1, ours.output[-3000:]
    for feature in TURNED_OFF:
        assert f"{feature} off on pretrain_transformers.py (on under --use-flowtrain): " \
               f"{NOT_ON_THIS_PATH[feature]}" in features[0]


def test_packing_and_schedule_asked_for_by_name_are_refused_at_start_up(real_jobs):
    refused = real_jobs.run("q3_refused", JOBS["q3_refused"], check=False)
    assert refused.returncode != 0 and not refused.losses
    lines = [line for line in refused.output.splitlines() if "mindspeed-flow: refusing to start: " in line]
    assert lines, refused.output[-3000:]
    for feature in ("packing", "schedule"):
        assert f"{feature} ({NOT_ON_THIS_PATH[feature]})" in lines[0]
    assert "Traceback" not in refused.output.split("mindspeed-flow: refusing to start: ")[0]


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
