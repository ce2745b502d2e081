"""The real job's data path under the plugin (issue 19, defects 7 and 8).

- Defect 7: ``--use-flowtrain`` at TP=2 adds ``--sequence-parallel``, whose embedding
  reduce-scatter needs every pack's length divisible by TP; the packing loader pads each
  pack (a masked segment of its own) and the run finishes its 8 iterations.
- Defect 8: with ``val_rate: 0.25`` MindSpeed-MM holds out 24 of 96 samples and evaluates
  on them at ``--eval-interval``; the plugin's run holds out exactly the samples upstream
  evaluates, never trains on them, evaluates through the packing loader and logs
  ``validation loss``.  A ``val_dataset`` file is the validation set, and ``val_rate`` is
  then ignored, as upstream does.

Runs (each 8 iterations, reused by the assertions): upstream with ``val_rate``; the plugin
at TP=2 ``--sequence-parallel`` with the same data config (both defects in one run); the
plugin with ``val_dataset``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from realjob import RealJob, make_assets

SAMPLES = 96
HELD_OUT = 24  # val_rate 0.25 of 96
ITERS = 8
EVAL_INTERVAL = 4
# Upstream evaluates eval_iters x global batch samples per evaluation: 6 x 4 = the 24 held out.
# The plugin evaluates eval_iters x microbatches packs: 2 x 4 packs at iterations 4, 8 and after
# training are 24 packs, at least one epoch of the 24 held-out samples.
UPSTREAM_VAL = RealJob(samples=SAMPLES, val_rate=0.25, eval_interval=EVAL_INTERVAL, eval_iters=6)
FLOW_TP2_VAL = RealJob(samples=SAMPLES, tp=2, plugin=("--use-flowtrain",), extra_args=("--sequence-parallel",),
                       val_rate=0.25, eval_interval=EVAL_INTERVAL, eval_iters=2)
VAL_TAGS = set(range(10000 - 8, 10000))  # realjob.make_assets: the 8-sample validation file
VALUE = re.compile(r"loss value: ([-+0-9.eE]+)")
# A run with evaluation takes longer than pytest's default 300 s on the loaded CI machine.
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture
def upstream_val(real_jobs):
    return real_jobs.run("data_up_val_rate", UPSTREAM_VAL)


@pytest.fixture
def flow_tp2_val(real_jobs):
    return real_jobs.run("data_flow_tp2_sp_val_rate", FLOW_TP2_VAL)


def absolute_val_file(real_jobs) -> Path:
    """The harness's validation file with absolute image paths: MindSpeed-MM resolves an image
    as ``dataset_dir`` (the training corpus's folder) joined with its path when that file
    exists, else as written, and the harness's file is relative to its own folder."""
    assets = make_assets(real_jobs.root / f"assets_{SAMPLES}", SAMPLES)
    records = json.loads(assets.val_corpus.read_text())
    for record in records:
        record["images"] = [str(assets.val_corpus.parent / p) for p in record["images"]]
    path = real_jobs.root / "data_val_dataset" / "val.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(records))
    return path


@pytest.fixture
def flow_val_file(real_jobs):
    job = RealJob(samples=SAMPLES, plugin=("--use-flowtrain",), val_rate=0.25, eval_interval=EVAL_INTERVAL,
                  eval_iters=2,
                  data_patch=(("dataset_param.basic_parameters.val_dataset", str(absolute_val_file(real_jobs))),))
    return real_jobs.run("data_flow_val_dataset", job)


def _tags(entries) -> set[int]:
    return {t for _, _, tags in entries for t in tags}


def _validation_values(run) -> list[float]:
    values = [float(m.group(1)) for line in run.validation for m in [VALUE.search(line)] if m]
    assert values, f"no 'validation loss at ...' line with a loss value:\n{run.output[-4000:]}"
    return values


def test_tp2_sequence_parallel_packs_padded_to_tp_and_runs_all_iterations(flow_tp2_val):
    run = flow_tp2_val
    assert sorted(run.losses) == list(range(1, ITERS + 1))
    assert all(math.isfinite(v) for v in run.losses.values())
    batches = [b for b in run.batches if b.get("cu_seqlens")]
    assert batches and all(b["shape"][1] % 2 == 0 for b in batches)
    # some pack needed padding: its last segment holds no sample (no tag), and nothing attends across
    padded = [b for b in batches if not b["rows"][0][-1]["tags"]]
    assert padded, "no pack of this run needed padding: the test does not see defect 7"
    llm = [a for a in run.attention if a.get("packed")]
    assert llm and not any(a["crosses"] for a in run.attention)
    assert "packs padded to a multiple of 2 tokens" in run.output


def test_val_rate_holds_out_upstreams_samples_never_trained_on(upstream_val, flow_tp2_val):
    held = _tags(upstream_val.evaluated)
    assert len(held) == HELD_OUT
    assert not held & set(upstream_val.fed_samples())
    evaluated = _tags(flow_tp2_val.evaluated)
    assert evaluated == held  # the same held-out samples, every one evaluated
    trained = flow_tp2_val.fed_samples()
    assert not held & set(trained)
    everything = set(range(SAMPLES))
    assert flow_tp2_val.consumed[ITERS] >= SAMPLES - HELD_OUT  # more than one epoch of the training part
    assert set(trained) == everything - held


def test_validation_loss_logged_at_the_eval_interval(upstream_val, flow_tp2_val):
    for run in (upstream_val, flow_tp2_val):
        at = sorted({int(m.group(1)) for line in run.validation
                     for m in [re.search(r"validation loss at iteration (\d+) \|", line)] if m})
        assert at == [EVAL_INTERVAL, ITERS], run.validation
        assert all(math.isfinite(v) and v > 0 for v in _validation_values(run))
    # the same model at iteration 0 would give the same loss; after 4 steps both are near ln(vocab)
    up, flow = _validation_values(upstream_val)[0], _validation_values(flow_tp2_val)[0]
    assert abs(up - flow) < 0.05 * up


def test_val_dataset_is_the_validation_set_and_val_rate_is_ignored(flow_val_file):
    run = flow_val_file
    assert sorted(run.losses) == list(range(1, ITERS + 1))
    val_tags = VAL_TAGS
    assert _tags(run.evaluated) == val_tags
    _validation_values(run)
    trained = run.fed_samples()
    assert not val_tags & set(trained)
    if run.consumed[ITERS] >= SAMPLES:  # a whole epoch: val_rate held nothing out of the training file
        assert set(trained) == set(range(SAMPLES))
    assert "val_rate is ignored" in run.output
