"""The main job's plumbing without a model: config errors name the file and the key, upstream
noise is counted per message, and a failing rank stops every rank with its traceback."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import pytest

from mindspeed_flow.train.config import ConfigError, check_resume, load_config
from mindspeed_flow.train.launch import RankFailed, run_world
from mindspeed_flow.train.warnings_log import Noise, capture, summary

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["demo.yaml", "ci.yaml"])
def test_shipped_configs_load(name):
    cfg = load_config(ROOT / "configs" / "train" / name)
    assert cfg.layout.world_size % cfg.layout.baseline_pp == 0
    assert 0 < cfg.resume_at < cfg.steps
    assert cfg.checkpoint_path == Path(cfg.report_dir) / "checkpoint"


@pytest.mark.parametrize("text, message", [
    ("data:\n  capacty: 512\n", r"unknown key data\.capacty \(known in data: path, samples"),
    ("data:\n  capacity: many\n", r"data\.capacity: expected int, got str 'many'"),
    ("layout:\n  use_allocator: 1\n", r"layout\.use_allocator: expected bool, got int 1"),
    ("optim:\n  betas: [0.9]\n", r"optim\.betas: expected a list of 2 numbers"),
    ("model:\n  llm_layers: 2.5\n", r"model\.llm_layers: expected int, got float 2\.5"),
    ("layout:\n  world_size: 3\n", r"layout\.baseline_pp: 2 does not divide layout\.world_size 3"),
    ("layout:\n  pool_backend: nfs\n", r"layout\.pool_backend: 'nfs' is not one of"),
    ("layout:\n  max_ahead: 0\n", r"layout\.max_ahead: must be >= 1, got 0"),
    ("layout:\n  flow_encoder_dp: 0\n", r"layout\.flow_encoder_dp: must be >= 1, got 0"),
    ("layout:\n  flow_backbone_pp: -1\n", r"layout\.flow_backbone_pp: must be >= 1, got -1"),
    ("layout:\n  flow_backbone_dp: 0\n", r"layout\.flow_backbone_dp: must be >= 1, got 0"),
    ("layout:\n  world_size: 0\n", r"layout\.world_size: must be >= 1, got 0"),
    ("data:\n  max_pixels: 0\n", r"data\.max_pixels: must be >= 1, got 0"),
    ("data:\n  make_demo: yes please\n", r"data\.make_demo: expected bool, got str"),
    ("layout:\n  best_baseline_pp: 3\n", r"layout\.best_baseline_pp: 3 is not a pipeline size a co-located run can take here"),
    ("layout:\n  best_baseline_pp: 2\n", r"layout\.best_baseline_pp: 2 is layout\.baseline_pp already"),
    ("model:\n  llm_layers: 2\nlayout:\n  best_baseline_pp: 4\n",
     r"layout\.best_baseline_pp: 4 is not a pipeline size a co-located run can take here .* at most model\.llm_layers 2"),
    ("layout:\n  text_only_pp: 3\n", r"layout\.text_only_pp: 3 does not divide layout\.world_size 4"),
    ("layout:\n  text_only_pp: 0\n", r"layout\.text_only_pp: must be >= 1, got 0"),
    ("- a\n- b\n", r"the top level must be a mapping"),
    ("data: [1, 2\n", r"not valid YAML"),
])
def test_config_errors_name_the_file_and_the_key(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_best_baseline_is_the_baseline_at_its_own_pipeline_size(tmp_path):
    path = tmp_path / "best.yaml"
    path.write_text("layout:\n  baseline_pp: 2\n  best_baseline_pp: 1\n")
    cfg = load_config(path)
    name, best = cfg.best_baseline()
    assert name == "baseline-pp1" and best.layout.baseline_pp == 1 and best.baseline_dp == 4
    # everything else is the main baseline's: same samples, init, microbatches, optimizer
    assert (best.data, best.model, best.optim, best.seed, best.steps) == (cfg.data, cfg.model, cfg.optim, cfg.seed,
                                                                           cfg.steps)
    path.write_text("layout:\n  best_baseline_pp: null\n")
    assert load_config(path).best_baseline() is None


def test_resume_needs_a_step_to_stop_after(tmp_path):
    path = tmp_path / "resume.yaml"
    path.write_text("steps: 4\nresume_at: 4\n")
    cfg = load_config(path)  # fine without the resume check
    with pytest.raises(ConfigError, match=r"resume_at: must be between 1 and steps - 1 = 3 .*got 4"):
        check_resume(cfg, path)


def test_cli_prints_a_config_error_without_a_traceback(tmp_path, capsys):
    from mindspeed_flow.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text("steps: 0\n")
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: steps: must be >= 1, got 0" in err and "Traceback" not in err


def test_a_missing_data_path_is_refused_naming_it_unless_the_config_makes_the_demo(tmp_path, capsys):
    """A typo in data.path exits 2 naming the path and makes nothing (it used to train on a
    generated demo corpus with rc 0); ``data.make_demo: true`` makes the demo corpus there."""
    from mindspeed_flow.cli import main
    from mindspeed_flow.train.feed import ensure_corpus

    missing = tmp_path / "corpra" / "typo"
    path = tmp_path / "typo.yaml"
    path.write_text(f"data:\n  path: {missing}\n")
    assert main(["train", str(path), "--no-resume-check"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: data.path: {missing} does not exist" in err and "data.make_demo: true" in err, err
    assert "Traceback" not in err and not missing.exists() and not missing.parent.exists()
    (tmp_path / "empty").mkdir()
    path.write_text(f"data:\n  path: {tmp_path / 'empty'}\n  make_demo: true\n")
    with pytest.raises(ConfigError, match=r"data\.path: .*empty exists but holds no \.json/\.jsonl"):
        ensure_corpus(load_config(path))
    path.write_text(f"data:\n  path: {missing}\n  make_demo: true\n  samples: 8\n")
    assert ensure_corpus(load_config(path)) == missing and any(missing.glob("*.jsonl"))


def test_config_overrides_and_float_strings(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("optim:\n  lr: 1e-3\nsteps: 5\n")  # YAML 1.1 reads 1e-3 as a string
    cfg = load_config(path, steps=7, world_size=2)
    assert cfg.optim.lr == 1e-3 and cfg.steps == 7 and cfg.layout.world_size == 2


def test_capture_counts_warnings_logs_and_output_lines():
    import logging

    with capture() as captured:
        for _ in range(3):
            warnings.warn("Apex is not installed. Falling back to Torch Norm")
        logging.getLogger("megatron.core").warning("no TE")
        print("printed by upstream")
        os.write(2, b"written to fd 2\n")
    counts = {(k, m.split(" (")[0]): c for (k, m), c in captured.noise.counts.items()}
    assert counts[("warning", "UserWarning: Apex is not installed. Falling back to Torch Norm")] == 3
    assert counts[("log", "WARNING megatron.core: no TE")] == 1
    assert counts[("output", "printed by upstream")] == 1
    assert counts[("output", "written to fd 2")] == 1
    merged = Noise.from_json(captured.noise.to_json()).merge(Noise.from_json(captured.noise.to_json()))
    text = summary(merged, ranks=2)
    assert text.count("Apex is not installed") == 1 and "   6x [warning]" in text


def _fail_on_rank_one(env, emit, pid_dir):
    Path(pid_dir, f"{env.rank}.pid").write_text(str(os.getpid()))
    emit({"rank": env.rank})
    if env.rank == 1:
        raise ValueError("planted failure on rank 1")
    time.sleep(120)  # rank 0 would hang here: the launcher must stop it
    return env.rank


def _rank_and_device(env, emit):
    import torch.distributed as dist

    emit({"rank": env.rank})
    return env.rank, dist.get_world_size(), env.backend, env.device.type


def test_spawned_ranks_return_results_and_only_rank_zero_reports():
    events = []
    results, noise = run_world(_rank_and_device, 2, on_event=events.append, timeout_s=120, megatron=False)
    assert results == [(0, 2, "gloo", "cpu"), (1, 2, "gloo", "cpu")]
    assert events == [{"rank": 0}]
    assert isinstance(noise, Noise)


def test_a_failing_rank_stops_every_rank_with_its_traceback(tmp_path):
    started = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 failed first") as info:
        run_world(_fail_on_rank_one, 2, str(tmp_path), timeout_s=120, megatron=False)
    assert "ValueError: planted failure on rank 1" in str(info.value)
    assert time.monotonic() - started < 100  # not the sleeping rank's 120 s
    for rank in (0, 1):
        pid = int((tmp_path / f"{rank}.pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_device_choice_cuda_is_a_mock_here(monkeypatch):
    """No GPU exists on this machine: CUDA is mocked (is_available/device_count) to check
    the choice only; nccl on cuda:<local rank> needs a GPU per local rank, else gloo on CPU."""
    import torch

    from mindspeed_flow.train.launch import make_env

    cpu = make_env(1, 4, 1, 4)
    if not torch.cuda.is_available():
        assert (cpu.backend, cpu.device.type, cpu.cpu) == ("gloo", "cpu", True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    gpu = make_env(5, 8, 1, 4)
    assert (gpu.backend, gpu.device, gpu.cpu) == ("nccl", torch.device("cuda", 1), False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # fewer GPUs than local ranks
    assert make_env(1, 4, 1, 4).backend == "gloo"

