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
  ``flash_attention_2``.
"""

from __future__ import annotations

import math
from collections import Counter

from realjob_run import RealRun
from realjob_transformers import TransformersJob

ITERS = 8
JOBS = {
    "q3_up": TransformersJob(iters=ITERS),
}


def run(real_jobs, name: str) -> RealRun:
    return real_jobs.run(name, JOBS[name])


def assert_finished(run: RealRun) -> None:
    assert run.returncode == 0
    assert sorted(run.losses) == list(range(1, ITERS + 1)), run.output[-3000:]
    assert all(math.isfinite(v) for v in run.losses.values())
    for i, loss in run.exact_losses.items():  # the log prints what the step returned
        assert float(f"{loss:.6E}") == run.losses[i]


def assert_consumed_is_fed(run: RealRun) -> None:
    fed = {iteration: tags for iteration, _, tags in run.fed}
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
