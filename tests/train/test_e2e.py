"""The main job end to end: ``mindspeed-flow train configs/train/ci.yaml --ablation`` run once
as the README runs it (a subprocess spawning 4 gloo ranks; ``--ablation``: every run, the
ablation chain and the text-only bound too), then its report checked against itself: every
run finished every step over the same samples, parity losses agree, the resumed run
continued exactly, the report's numbers are the measured ones (rates recomputed from the
per-step records, padding of the packed run below the baseline's, each chain step's
"bought" ratio from the two runs' samples/s), the chain's runs train the same model (same
losses) and the text-only run the same token counts as flowtrain.  The terminal output is
checked to stay readable (upstream warnings counted, not repeated)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from mindspeed_flow.train.config import load_config
from markers import requires_megatron_core

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "train" / "ci.yaml"

pytestmark = requires_megatron_core


def _command() -> list[str]:
    script = Path(sys.executable).parent / "mindspeed-flow"
    return [str(script)] if script.exists() else [sys.executable, "-m", "mindspeed_flow.cli"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One run of the CI config with every run (``--ablation``) in a scratch directory (its
    own demo corpus under outputs/demo_data there, the report in report/)."""
    work = tmp_path_factory.mktemp("train_e2e")
    report = work / "report"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(_command() + ["train", str(CONFIG), "--ablation", "--report", str(report)], cwd=work,
                          env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mindspeed-flow train failed ({proc.returncode}):\n{output[-6000:]}"
    metrics = json.loads((report / "metrics.json").read_text())
    return {"cfg": load_config(CONFIG), "report": report, "output": output, "metrics": metrics,
            "job": json.loads((report / "job.json").read_text())}


def _steps(job, run):
    return job["metrics"]["runs"][run]["record"]["steps"]


def test_both_runs_finish_every_step_on_the_same_samples(job):
    cfg = job["cfg"]
    base, flow = _steps(job, "baseline"), _steps(job, "flowtrain")
    assert [s["step"] for s in base] == [s["step"] for s in flow] == list(range(1, cfg.steps + 1))
    # the same global batch each step: same sample and real-token counts
    assert [(s["samples"], s["tokens"]) for s in base] == [(s["samples"], s["tokens"]) for s in flow]
    for run in ("baseline", "flowtrain"):
        record = job["metrics"]["runs"][run]["record"]
        assert sorted(r["rank"] for r in record["ranks"]) == list(range(cfg.layout.world_size))
        assert {iv["rank"] for iv in record["timeline"]} == set(range(cfg.layout.world_size))
        assert all(r["peak_memory_mb"] > 0 and 0 <= r["idle_fraction"] < 1 for r in record["ranks"])
        losses = [s["loss"] for s in record["steps"]]
        assert all(0 < loss < 20 for loss in losses), losses


def test_the_best_config_baseline_trains_the_same_steps_on_the_same_samples(job):
    """``baseline-pp1`` (``layout.best_baseline_pp``): the same baseline at PP=1 x DP=4
    finishes the same steps over the same samples from the same init, so its losses are the
    PP=2 baseline's (same padded microbatches, only the pipeline split differs)."""
    cfg = job["cfg"]
    name, best_cfg = cfg.best_baseline()
    base, best = _steps(job, "baseline"), _steps(job, name)
    assert [s["step"] for s in best] == list(range(1, cfg.steps + 1))
    assert [(s["samples"], s["tokens"], s["padded_tokens"]) for s in best] == \
        [(s["samples"], s["tokens"], s["padded_tokens"]) for s in base]
    assert [s["loss"] for s in best] == pytest.approx([s["loss"] for s in base], rel=1e-4)
    record = job["metrics"]["runs"][name]["record"]
    assert record["layout"].startswith(f"PP={best_cfg.layout.baseline_pp} x DP={best_cfg.baseline_dp}")
    assert "no pipeline (megatron-core)" in record["features"]
    assert sorted(r["rank"] for r in record["ranks"]) == list(range(cfg.layout.world_size))
    flow = job["metrics"]["runs"]["flowtrain"]
    for baseline in ("baseline", name):
        assert flow["ratio_to"][baseline]["samples_per_s"] == pytest.approx(
            flow["derived"]["samples_per_s"] / job["metrics"]["runs"][baseline]["derived"]["samples_per_s"], rel=1e-9)
    assert f"x {name}" in job["output"] and (job["report"] / f"gantt_{name}.png").stat().st_size > 0


def test_the_thd_and_three_phase_baselines_train_the_same_model_and_flowtrain_is_compared_with_each(job):
    """``baseline-thd`` (packed THD Megatron, ViT in stage 0, 1F1B) and ``three-phase`` (ViT
    forward over the step on every rank, LLM 1F1B on detached embeddings, ViT backward)
    finish the same steps over the same samples, unpadded, to the baseline's losses (the
    chain's tolerance), and the report gives flowtrain's ratio against each beside the
    MindSpeed-MM-style one."""
    runs, base = job["metrics"]["runs"], _steps(job, "baseline")
    for name, feature in (("baseline-thd", "ViT in stage 0"), ("three-phase", "three-phase")):
        steps = _steps(job, name)
        assert [(s["step"], s["samples"], s["tokens"]) for s in steps] == [(s["step"], s["samples"], s["tokens"])
                                                                         for s in base]
        assert all(s["padded_tokens"] == s["tokens"] for s in steps)
        assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in base], rel=1e-4)
        features = runs[name]["record"]["features"]
        assert "varlen attention" in features and "Conv->Matmul" in features
        assert any(feature in f for f in features), features
        flow = runs["flowtrain"]
        assert flow["ratio_to"][name]["samples_per_s"] == pytest.approx(
            flow["derived"]["samples_per_s"] / runs[name]["derived"]["samples_per_s"], rel=1e-9)
        assert f"x {name}" in job["output"]
    regions = {iv["region"] for iv in runs["three-phase"]["record"]["timeline"] if iv["rank"] == 3}
    assert regions == {"vit", "llm"}  # a last-stage rank encodes too (a ViT replica on every rank)


def _table_cell(output: str, run: str, column: str) -> str:
    """The terminal table's ``column`` of ``run``'s line (numbers are right-aligned under their header)."""
    lines = output.splitlines()
    header = next(line for line in lines if line.startswith("run ") and column in line)
    row = next(line for line in lines[lines.index(header):] if line.startswith(run + " "))
    return row[:header.index(column) + len(column)].split()[-1]


def test_the_ablation_chain_trains_the_same_model_and_reports_what_each_feature_bought(job):
    """Each chain run adds one switch to the run before it (job.json), trains the same steps
    over the same samples to the same losses (packed samples attend only within themselves,
    or the losses would differ from the padded baseline's), and its "bought" entry and table
    cell are its samples/s over the run before's; the summary names the largest."""
    from mindspeed_flow.train.runs import ablation_chain

    cfg, runs = job["cfg"], job["metrics"]["runs"]
    chain = ablation_chain(cfg)
    switches = job["job"]["run_switches"]
    base = _steps(job, "baseline")
    gains = {}
    for before, spec in zip(chain, chain[1:]):
        assert switches[spec.name] == dataclasses.asdict(spec.features)
        assert sum(switches[spec.name][k] != v for k, v in switches[before.name].items()) == 1
        steps = _steps(job, spec.name)
        assert [(s["step"], s["samples"], s["tokens"]) for s in steps] == [(s["step"], s["samples"], s["tokens"])
                                                                         for s in base]
        assert [s["loss"] for s in steps] == pytest.approx([s["loss"] for s in base], rel=1e-4)
        entry = runs[spec.name]
        ratio = entry["derived"]["samples_per_s"] / runs[before.name]["derived"]["samples_per_s"]
        assert entry["bought"] == {"previous": before.name, "adds": spec.adds,
                                   "samples_per_s": pytest.approx(ratio, rel=1e-9),
                                   "tokens_per_s": pytest.approx(ratio, rel=1e-9)}
        assert _table_cell(job["output"], spec.name, "bought") == f"{ratio:.2f}x"
        gains[spec.name] = ratio
    assert _steps(job, "packing")[0]["padded_tokens"] == base[0]["tokens"] < base[0]["padded_tokens"]
    assert "varlen attention" in runs["varlen"]["record"]["features"]
    assert "Conv->Matmul" in runs["conv-matmul"]["record"]["features"]
    best = max(gains, key=gains.__getitem__)
    assert job["metrics"]["largest_gain"]["run"] == best
    adds = next(spec.adds for spec in chain if spec.name == best)
    assert f"the largest gain came from {adds}: {best} is {gains[best]:.2f}x" in job["output"]


def test_the_text_only_run_feeds_flowtrains_token_counts_and_bounds_it(job):
    """The upper bound: the same backbone on the same token sequences (the image tokens as
    text), so every step has flowtrain's samples, real and computed tokens; no rank runs a
    ViT; flowtrain's fraction of its throughput is the two measured rates' ratio."""
    text, flow = _steps(job, "text-only"), _steps(job, "flowtrain")
    assert [(s["step"], s["samples"], s["tokens"], s["padded_tokens"]) for s in text] == \
        [(s["step"], s["samples"], s["tokens"], s["padded_tokens"]) for s in flow]
    runs = job["metrics"]["runs"]
    record = runs["text-only"]["record"]
    assert all(r["role"].endswith("(LLM)") for r in record["ranks"])
    assert {iv["region"] for iv in record["timeline"]} == {"llm"}
    fraction = runs["flowtrain"]["derived"]["samples_per_s"] / runs["text-only"]["derived"]["samples_per_s"]
    assert runs["flowtrain"]["fraction_of_text_only"]["samples_per_s"] == pytest.approx(fraction, rel=1e-9)
    assert f"flowtrain reaches {fraction:.0%} of the text-only throughput" in job["output"]
    assert _table_cell(job["output"], "flowtrain", "of text-only") == f"{fraction:.0%}"


def test_report_rates_are_the_measured_ones(job):
    for run in job["metrics"]["runs"]:
        entry = job["metrics"]["runs"][run]
        measured = entry["record"]["steps"][1:]  # the warm-up step is left out of the rates
        seconds = sum(s["step_s"] for s in measured)
        derived = entry["derived"]
        assert derived["samples_per_s"] == pytest.approx(sum(s["samples"] for s in measured) / seconds, rel=1e-9)
        assert derived["tokens_per_s"] == pytest.approx(sum(s["tokens"] for s in measured) / seconds, rel=1e-9)
        steps = entry["record"]["steps"]
        padding = 1 - sum(s["tokens"] for s in steps) / sum(s["padded_tokens"] for s in steps)
        assert derived["padding_fraction"] == pytest.approx(padding, abs=1e-12)
    runs = job["metrics"]["runs"]
    assert runs["flowtrain"]["derived"]["padding_fraction"] < runs["baseline"]["derived"]["padding_fraction"]
    ratio = runs["flowtrain"]["ratio_to_baseline"]["samples_per_s"]
    assert ratio == pytest.approx(runs["flowtrain"]["derived"]["samples_per_s"]
                                  / runs["baseline"]["derived"]["samples_per_s"], rel=1e-9)


def test_parity_losses_are_equal(job):
    parity = job["metrics"]["parity"]
    assert parity["passed"], parity
    assert parity["steps"] == list(range(1, job["cfg"].parity_steps + 1))
    first, *rest = [abs(a - b) / abs(a) for a, b in zip(parity["baseline"], parity["flowtrain"])]
    assert first <= 1e-5 and all(d <= 1e-4 for d in rest), parity
    assert "parity PASS" in job["output"]


def test_resume_continues_exactly(job):
    resume, cfg = job["metrics"]["resume"], job["cfg"]
    assert resume["passed"] and resume["stop_step"] == cfg.resume_at
    flow_losses = [s["loss"] for s in _steps(job, "flowtrain")]
    assert resume["uninterrupted"] == flow_losses
    assert resume["resumed"] == flow_losses  # bit for bit, every step after the resume too
    assert resume["max_abs_deviation"] == 0 and resume["repeated_samples"] == []
    assert job["job"]["resume_same_samples"] is True
    assert (job["report"] / "checkpoint" / "rank000.pt").exists()
    assert "resume PASS" in job["output"]


def test_report_files_and_readable_terminal(job):
    report = job["report"]
    for name in ("summary.md", "loss_curves.png", "gantt_baseline.png", "gantt_flowtrain.png"):
        assert (report / name).stat().st_size > 0, name
    for name in ("loss_curves.png", "gantt_baseline.png", "gantt_flowtrain.png"):
        assert (report / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    summary = (report / "summary.md").read_text()
    assert "parity PASS" in summary and "resume PASS" in summary
    # upstream noise: counted from the ranks into warnings.json, each message printed at most once
    noise = json.loads((report / "warnings.json").read_text())
    printed = Counter(line.split("] ", 1)[1] for line in job["output"].splitlines() if "x [" in line and "] " in line)
    assert all(count == 1 for count in printed.values()), printed
    apex = [row for row in noise if "Apex is not installed" in row["message"]]
    assert apex and sum(row["count"] for row in apex) > len(apex)  # raised in several ranks ...
    assert job["output"].count("Apex is not installed") == len(apex)  # ... printed once each


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_under_torchrun_each_process_is_one_rank_and_rank_zero_reports(tmp_path):
    """The same command started by torchrun (RANK/WORLD_SIZE set): the ranks do not spawn,
    every one makes the missing corpus without clobbering the others, rank 0 gathers the
    results and the warnings and writes the report (the parity phase only, to stay short)."""
    report = tmp_path / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1",
         "--master-port", str(_free_port()), "-m", "mindspeed_flow.cli", "train", str(CONFIG), "--parity",
         "--report", str(report)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    metrics = json.loads((report / "metrics.json").read_text())
    assert metrics["parity"]["passed"] and metrics["runs"] == {}
    assert output.count("parity PASS") == 1 and output.count("report: ") == 1  # rank 0 alone reports
    noise = json.loads((report / "warnings.json").read_text())
    assert sum(row["count"] for row in noise if "Apex is not installed" in row["message"]) > 1  # from several ranks
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["demo_data"]  # no stray private copies


def _is_spawned_rank(process) -> bool:
    import psutil

    try:
        return any("spawn_main" in part for part in process.cmdline())
    except psutil.Error:  # ended meanwhile
        return False


def test_ctrl_c_stops_every_rank_and_leaves_no_pool_behind(tmp_path):
    """Ctrl-C in the terminal (SIGINT to the whole process group) during the flowtrain
    phase: exit 130 with one line, no rank left running, no shm pool left in /dev/shm."""
    import signal
    import time

    import psutil

    # flowtrain alone, for many steps: the interrupt lands while it trains, not as the job ends
    # (a pool seen only in a short last phase let the job finish first under load: exit 0)
    command = ["train", str(CONFIG), "--only", "flowtrain", "--no-resume-check", "--steps", "60",
               "--report", str(tmp_path / "report")]
    # A terminal's job takes Ctrl-C: SIGINT at its default, whatever this test inherited (a
    # runner started in the background, `cmd &` in a script, ignores SIGINT, and so would the
    # job: it ran to the end and exited 0)
    proc = subprocess.Popen(_command() + command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        os.set_blocking(proc.stdout.fileno(), False)
        output, pools, deadline = b"", [], time.monotonic() + 300
        while not pools and proc.poll() is None and time.monotonic() < deadline:  # until flowtrain's pool exists
            output += proc.stdout.read() or b""
            children = psutil.Process(proc.pid).children(recursive=True)
            ranks = [p for p in children if _is_spawned_rank(p)]
            pools = [path for p in ranks for path in Path("/dev/shm").glob(f"*train{p.pid}x*")]
            time.sleep(0.05)
        assert pools, f"no flowtrain pool seen in /dev/shm: {output.decode(errors='replace')[-3000:]}"
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 130
        output += proc.stdout.read() or b""
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert b"interrupted; every rank was stopped" in output
    assert len(ranks) == 4
    assert not [p.pid for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    # the rest (multiprocessing's resource tracker) ends by itself once the parent is gone
    _, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"still running after the job: {[p.cmdline() for p in alive]}"
    assert not [path for path in pools if path.exists()], "the interrupted job's pool is still in /dev/shm"

