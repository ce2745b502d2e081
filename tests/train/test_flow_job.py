"""``mindspeed-flow train`` with FlowTrain's flow on (``layout.flow: true``) and a frozen ViT
that runs ahead: one run of the CI config's model and data, 3 steps, stopped after step 1.

- The job's own checks pass: parity (the flow's losses equal the MindSpeed-MM-style
  baseline's over the same samples) and resume (a new trainer and feed, loaded from the
  checkpoint written after step 1, train steps 2 and 3 to the uninterrupted run's losses bit
  for bit, fed exactly its samples: none lost, none twice).
- The checkpoint was written while each producer's step-2 entries were already in the pool
  (``ahead_not_saved``: encoded during step 1, not in the checkpoint), so the resumed run
  encoded them again; its steps still equal the uninterrupted run's.
- The report's timeline shows the producers encoding the next step's batches during the
  step (intervals with ``ahead == 1``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from markers import requires_megatron_core

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "train" / "ci.yaml"

pytestmark = requires_megatron_core


@pytest.fixture(scope="module")
def flow_job(tmp_path_factory):
    work = tmp_path_factory.mktemp("train_flow")
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["model"]["freeze_vit"] = True
    cfg["layout"]["flow"] = True
    cfg.update(steps=3, resume_at=1, parity_steps=2)
    config = work / "flow.yaml"
    config.write_text(yaml.safe_dump(cfg))
    report = work / "report"
    script = Path(sys.executable).parent / "mindspeed-flow"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "mindspeed_flow.cli"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # no run named: baseline, flowtrain, text-only, then the parity and resume phases
    proc = subprocess.run(command + ["train", str(config), "--report", str(report)], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mindspeed-flow train with layout.flow failed ({proc.returncode}):\n{output[-6000:]}"
    return {"report": report, "output": output, "metrics": json.loads((report / "metrics.json").read_text()),
            "job": json.loads((report / "job.json").read_text()), "world": cfg["layout"]["world_size"]}


def test_the_jobs_parity_and_resume_checks_pass_with_the_flow(flow_job):
    out = flow_job["output"]
    assert "parity PASS" in out and "resume PASS (flowtrain)" in out
    assert flow_job["job"]["resume_same_samples"] is True
    record = flow_job["metrics"]["runs"]["flowtrain"]["record"]
    assert "(flow, frozen: runs ahead)" in record["layout"]
    assert any(r["role"].endswith("(flow producer)") for r in record["ranks"])
    steps, base = record["steps"], flow_job["metrics"]["runs"]["baseline"]["record"]["steps"]
    assert [(s["samples"], s["tokens"]) for s in steps] == [(s["samples"], s["tokens"]) for s in base]
    assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in base], rel=1e-4)


def test_the_checkpoint_left_step_2_entries_to_encode_again(flow_job):
    """Every producer had put step 2's entries before the checkpoint after step 1; none of
    them is in it, and the resume above still matched the uninterrupted run."""
    producers = 0
    for rank in range(flow_job["world"]):
        state = torch.load(flow_job["report"] / "checkpoint" / f"rank{rank:03d}.pt", weights_only=False)
        assert state["step"] == 1
        ahead = state["trainer"]["ahead_not_saved"]
        if "vit" in state["trainer"]["model"]:
            producers += 1
            assert ahead and all(key.startswith("flow/step2/act/") for key in ahead), ahead
        else:
            assert ahead == []
    assert producers == 2


def test_the_timeline_shows_the_producers_running_ahead(flow_job):
    timeline = flow_job["metrics"]["runs"]["flowtrain"]["record"]["timeline"]
    ahead = [iv for iv in timeline if iv["ahead"] == 1]
    assert ahead and {iv["region"] for iv in ahead} == {"vit"} and {"F", "PUT"} <= {iv["kind"] for iv in ahead}
    assert (flow_job["report"] / "gantt_flowtrain.png").stat().st_size > 0
