"""Shared upstream runs for the tests in this folder (each run is a subprocess of 10-40 s,
so every configuration runs once per session and several tests read it).

The runs need MindSpeed-MM's Python dependencies (transformers==4.57.0, diffusers, peft, ...),
installed by ``scripts/setup_upstream_env.sh`` into their own environment; ``.ci/run`` runs
this folder there through ``scripts/test_upstream.sh``, which sets
``MINDSPEED_FLOW_UPSTREAM_REQUIRED=1`` so that a missing dependency fails instead of skipping.
Elsewhere (the main suite's environment) the run-based tests skip and say why.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from dataclasses import replace
from pathlib import Path

import pytest

from harness import Job, UpstreamRun, run_upstream, sample_specs
from realjob import RealJobs

MODEL_DEPENDENCIES = ("transformers", "diffusers", "peft", "einops", "regex", "scipy", "sentencepiece", "beartype")
# What pretrain_vlm.py's imports and its "huggingface" data path add (realjob.py).
REAL_JOB_DEPENDENCIES = ("datasets", "pandas", "pyarrow", "PIL", "av", "pandarallel", "orjson", "ftfy", "bs4",
                         "sklearn", "sqlalchemy", "google.protobuf", "tokenizers", "accelerate")
REQUIRED_ENV = "MINDSPEED_FLOW_UPSTREAM_REQUIRED"

# Three samples of different image grids and text lengths: one per microbatch, or one pack.
SAMPLES = sample_specs(3)
# fp32 parameters with --use-flash-attn: MindSpeed's fused-attention path (stand-in kernel).
FP32 = Job(samples=SAMPLES, precision="fp32", flash_attn=True)
# Upstream's own bf16 setting without --use-flash-attn: MindSpeed's default attention path
# (Megatron's core attention, GenerateMaskFeature's wrapper, dense ViT block masks).
BF16 = Job(samples=SAMPLES, precision="bf16", flash_attn=False)


REPORTS: list[str] = []  # each run's stand-in report, printed at the end of the session


class Runs:
    """Upstream runs by name, each made on first use; plugin runs load the plain run's
    initial weights so every run starts from the same parameters."""

    def __init__(self, root: Path):
        self.root = root
        self._done: dict[str, UpstreamRun] = {}

    def _run(self, name: str, job: Job, plugin: bool, like: str | None = None) -> UpstreamRun:
        if name not in self._done:
            load = self.get(like).initial_weights if like else None
            self._done[name] = run_upstream(job, self.root / name, plugin=plugin, load=load)
            REPORTS.append(self._done[name].report)
        return self._done[name]

    def get(self, name: str) -> UpstreamRun:
        recipes = {
            "fp32_plain": (FP32, False, None),
            "fp32_flow": (FP32, True, "fp32_plain"),
            "fp32_flow_packed": (replace(FP32, layout="packed"), True, "fp32_plain"),
            "fp32_plain_packed": (replace(FP32, layout="packed"), False, "fp32_plain"),
            "fp32_flow_packed_pp2": (replace(FP32, layout="packed", pp=2), True, "fp32_plain"),
            "bf16_plain": (BF16, False, None),
            "bf16_flow": (BF16, True, "bf16_plain"),
        }
        job, plugin, like = recipes[name]
        return self._run(name, job, plugin, like)


def pinned(package: str) -> str | None:
    """The version ``constraints.txt`` pins ``package`` to with ``==``, if it does."""
    for line in (Path(__file__).parent / "constraints.txt").read_text().splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name.strip().lower() == package:
            return version.strip()
    return None


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # a dotted name whose parent is absent
        return True


def missing_dependencies(modules: tuple[str, ...] = MODEL_DEPENDENCIES) -> list[str]:
    """Dependencies that are absent, or present at another version than pinned."""
    missing = []
    for module in modules:
        if _absent(module):
            missing.append(module)
        elif pinned(module) and importlib.metadata.version(module) != pinned(module):
            missing.append(f"{module}=={pinned(module)} (found {importlib.metadata.version(module)})")
    return missing


def require(modules: tuple[str, ...], what: str) -> None:
    """Skip (or fail, under ``scripts/test_upstream.sh``) when a dependency is missing."""
    missing = missing_dependencies(modules)
    if missing:
        message = (f"{what} needs {', '.join(missing)} (MindSpeed-MM's pins): run "
                   "`bash scripts/test_upstream.sh`, which builds its own environment")
        if os.environ.get(REQUIRED_ENV):
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    require(MODEL_DEPENDENCIES, "upstream harness")
    return Runs(tmp_path_factory.mktemp("upstream_runs"))


REAL_JOBS: list[RealJobs] = []


@pytest.fixture(scope="session")
def real_jobs(tmp_path_factory) -> RealJobs:
    """The real job's runs (``realjob.py``), shared by name across this folder's tests."""
    require(MODEL_DEPENDENCIES + REAL_JOB_DEPENDENCIES, "the real-job harness")
    jobs = RealJobs(tmp_path_factory.mktemp("real_jobs"))
    REAL_JOBS.append(jobs)
    return jobs


def pytest_terminal_summary(terminalreporter) -> None:
    """What was real in the upstream runs: the stand-in symbols and the kernels each called."""
    if REPORTS:
        terminalreporter.section("upstream harness: stood in / called")
        for report in REPORTS:
            terminalreporter.write_line(report)
    for jobs in REAL_JOBS:
        if jobs.reports:
            terminalreporter.section("real job (pretrain_vlm.py): stood in / shimmed / wall time")
            for report in jobs.reports:
                terminalreporter.write_line(report)
            walls, cpus = jobs.wall_s, jobs.cpu_s
            terminalreporter.write_line(f"[real job] {len(walls)} runs, {sum(walls.values()):.0f} s wall, "
                                        f"{sum(cpus.values()):.0f} s CPU in all: "
                                        + ", ".join(f"{k} {walls[k]:.0f}/{cpus[k]:.0f} s" for k in walls))
