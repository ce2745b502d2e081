"""Allocator plans as a user makes them: ``mindspeed-flow plan CONFIG --devices N --out
PLAN`` in a subprocess, solved once per test session and shared by the tests that apply them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "allocator"
_PLANS: dict = {}


def cli_plan(config: str | Path, devices: int, tmp_path_factory: Any) -> tuple[Path, Any, str]:
    """``(file, AllocationPlan, printed text)`` of ``configs/allocator/CONFIG`` (or the
    config file at a path) at ``devices``."""
    from mindspeed_flow.allocator import AllocationPlan

    key = (config, devices)
    if key not in _PLANS:
        out = tmp_path_factory.mktemp("plan") / "plan.yaml"
        proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "plan", str(CONFIGS / config if isinstance(config, str) else config),
                               "--devices", str(devices), "--out", str(out)], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        _PLANS[key] = (out, AllocationPlan.load(out), proc.stdout)
    return _PLANS[key]


def runnable_config(tmp_path_factory: Any, name: str = "tiny_cpu.yaml") -> Path:
    """``configs/allocator/NAME`` asked for decoupled plans a ``DecoupledLayout`` runs: every
    backbone replica fed by as many encoder replicas (``megatron_blocks``), every device."""
    import yaml

    doc = yaml.safe_load((CONFIGS / name).read_text())
    doc["profile"] = str((CONFIGS / doc["profile"]).resolve())
    doc["workload"].update(placements=["decoupled"], megatron_blocks=True, exact_devices=True)
    out = tmp_path_factory.mktemp("allocator") / name
    out.write_text(yaml.safe_dump(doc))
    return out
