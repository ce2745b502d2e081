"""MindSpeed-MM's own ``--hetero-parallel`` (issue 24): its three-phase co-located step as a
baseline, upstream as is, on CPU (``realjob.py``), 8 iterations.

The LLM runs 1F1B over two stages (``text_decoder.pp = 2`` in the model JSON; the shell's
parallel sizes must be 1, as ``validate_args_patch`` requires) while the image encoder is data
parallel over both ranks (``image_encoder.pp = 1``): each rank encodes its half of every
micro-batch's images and the embeddings are all-gathered.  Two settings are forced by
upstream, not by the harness (``docs/realjob.md``, "MindSpeed-MM's --hetero-parallel"):
two samples per micro-batch (one image cannot be split over two encoder ranks:
``split_tensor_dp_group`` indexes past its chunks), and a frozen image encoder (its output
all-gather refuses a tensor that requires grad: ``NotImplementedError``).
"""

from __future__ import annotations

import pytest

from realjob import RealJob
from test_real_job import assert_finished

pytestmark = pytest.mark.timeout(1200)

# the RealJob for scripts/bench_realjob_layouts.py's row "hetero-parallel" too
HETERO = RealJob(
    pp=1, world_size=2, text_layers=2, mbs=2, gbs=8,
    extra_args=("--hetero-parallel",),
    model_patch=(("text_decoder.tp", 1), ("text_decoder.pp", 2), ("text_decoder.cp", 1),
                 ("text_decoder.pipeline_num_layers", [1, 1]),
                 ("image_encoder.tp", 1), ("image_encoder.pp", 1), ("image_encoder.cp", 1),
                 ("image_encoder.vision_encoder.freeze", True),
                 ("image_encoder.vision_projector.freeze", True)),
)


def test_hetero_parallel_runs_eight_iterations_with_the_encoder_over_both_ranks(real_jobs):
    run = real_jobs.run("hetero_pp2", HETERO)
    assert_finished(run)
    assert "hetero pipeline patches is activated" in run.output  # upstream's three-phase step ran
    assert "terminate called" not in run.output
