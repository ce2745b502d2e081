"""The device check (scripts/device_check.sh): its dry mode runs here on the CPU, so the
script a lent GPU will run cannot rot; device mode without CUDA stops at once."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_check.sh"


def _device_check():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dry_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("device_check")
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(SCRIPT), str(out), "--dry"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, json.loads((out / "device_check.json").read_text())


def test_dry_run_accounts_for_every_section(dry_report):
    out, report = dry_report
    check = _device_check()
    assert report["mode"] == "dry"
    assert list(report["sections"]) == list(check.SECTIONS)
    for name, section in report["sections"].items():
        assert section["status"] in check.STATUSES, name
        if section["status"] != "ran":
            assert isinstance(section["why"], str) and section["why"], f"{name} did not run and does not say why"


def test_dry_run_trains_the_job_and_benches_attention_on_cpu(dry_report):
    out, report = dry_report
    sections = report["sections"]
    assert sections["environment"]["status"] == "ran" and sections["environment"]["torch"]
    job = sections["main_job"]
    assert job["status"] == "ran" and job["world_size"] == 1
    (run,) = job["runs"].values()
    assert run["returncode"] == 0 and run["metrics"], run
    assert all(m["tokens_per_s"] > 0 for m in run["metrics"].values())
    attention = sections["attention"]
    assert attention["status"] == "ran" and attention["varlen_backend"] == "sdpa"
    assert attention["cases"] and all(c["varlen_s"] > 0 and c["dense_s"] > 0 for c in attention["cases"])
    assert "attention/attention.png" in report["pngs"]
    assert any(p.startswith(f"main_job/{run['report'].split('/')[-1]}/") for p in report["pngs"])
    assert all((out / p).is_file() for p in report["pngs"])


def test_multi_rank_benches_say_what_they_lack(dry_report):
    _, report = dry_report
    for name, script in (("schedule", "bench_schedule.py"), ("decoupled", "bench_decoupled.py")):
        section = report["sections"][name]
        has_device = '"--device"' in (ROOT / "scripts" / script).read_text()
        if has_device:
            assert section["status"] == "ran", section
        else:
            assert section["status"] == "not_available" and script in section["why"]
    decoupled = report["sections"]["decoupled"]
    if '"flow"' not in (ROOT / "scripts" / "bench_decoupled.py").read_text():  # the flow layout's note
        assert "the flow layout: " in (decoupled.get("also") or decoupled["why"])


def test_device_mode_without_cuda_fails_at_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "DEVICE_CHECK_DRY"}
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    if done.returncode == 0:
        pytest.skip("this machine has a CUDA device")  # the check then runs for real: not a unit test
    assert done.returncode == 1 and "no CUDA device" in done.stderr and "--dry" in done.stderr
    assert not (tmp_path / "out" / "device_check.json").exists()


def test_main_job_plan_whole_job_on_enough_gpus_single_rank_runs_otherwise(tmp_path):
    from mindspeed_flow.train.config import load_config

    check = _device_check()
    world = load_config(check.GPU_CONFIG).layout.world_size
    whole = check.main_job_plan(gpus=world, dry=False)
    assert whole["runs"] is None and whole["config"] == check.GPU_CONFIG and whole["why"] is None
    few = check.main_job_plan(gpus=1, dry=False)
    assert few["runs"] and "flowtrain" not in few["runs"] and f"need {world} GPUs" in few["why"]
    single = load_config(check.single_rank_config(check.GPU_CONFIG, tmp_path))  # a valid config on one rank
    assert single.layout.world_size == 1 and single.layout.baseline_pp == 1
