#!/usr/bin/env python
"""The device check (``scripts/device_check.sh OUT [--dry]``): what to run when a CUDA GPU is
lent, in one command of at most 8 minutes, writing ``OUT/device_check.json`` and PNGs.

Sections, each recorded as ``{"status": "ran" | "skipped" | "not_available" | "failed",
"why": ..., "seconds": ...}`` (``why`` says exactly why a section did not run, or what part of
it did not), the report rewritten after every section so that a run cut short still leaves
one:

- ``environment``: torch, CUDA devices, flash-attn.
- ``main_job``: ``mindspeed-flow train configs/train/gpu.yaml``.  The job uses nccl and
  ``cuda:<local rank>`` only with at least ``layout.world_size`` GPUs, one rank per GPU
  (:func:`mindspeed_flow.spawn.cuda_usable`; nccl refuses two ranks on one GPU).  With that
  many GPUs the whole job runs; with fewer, each single-rank run of the job (every run but
  the decoupled one, which needs an encoder rank and backbone ranks) runs on ``cuda:0`` from
  the config with ``world_size: 1`` and PP=1.  The report folders (PNGs included) are
  kept under ``OUT/main_job``.
- ``attention``: ``scripts/bench_attention.py`` (varlen vs a dense mask, Matmul vs Conv3d)
  with flash-attn's varlen kernel when flash-attn imports (an install is tried first, wheels
  only: a source build takes far longer than the budget), SDPA per segment otherwise.
- ``schedule``: the runtime's executor vs megatron-core's 1F1B (``scripts/bench_schedule.py``)
  and ``decoupled``: the decoupled and flow layouts vs the baselines
  (``scripts/bench_decoupled.py``), with real compute: run when the script has a real-compute
  ``--device`` option and the machine has the ranks' GPUs; otherwise ``not_available`` /
  ``skipped`` naming what is missing (in this version both emulate device time with sleeps on
  gloo CPU ranks, and bench_decoupled has no ``flow`` layout).

``--dry``: on the CPU, the tiny CI config (``configs/train/ci.yaml`` with ``world_size: 1``,
one step, the baseline run only), tiny attention sizes, the same decisions otherwise: what
CI runs so that this script cannot rot (``tests/test_device_check.py``).  Without ``--dry``
on a machine without CUDA it fails at once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
BUDGET_S = 480.0  # the whole check, device mode (8 minutes)
MARGIN_S = 15.0  # kept back for writing the report
SECTIONS = ("environment", "main_job", "attention", "schedule", "decoupled")
STATUSES = ("ran", "skipped", "not_available", "failed")
GPU_CONFIG = ROOT / "configs" / "train" / "gpu.yaml"
DRY_CONFIG = ROOT / "configs" / "train" / "ci.yaml"
# the job's runs that train on one rank (the decoupled FlowTrain run needs several)
SINGLE_RANK_RUNS = ("baseline", "packing", "varlen", "conv-matmul", "text-only")
FLASH_ATTN_INSTALL_S = 90.0


class NoCuda(SystemExit):
    """Device mode on a machine without a usable CUDA device: the check stops at once."""


class Check:
    """The report being written: one dict per section, saved after each."""

    def __init__(self, out: Path, dry: bool, budget_s: float) -> None:
        self.out, self.dry, self.budget_s = out, dry, budget_s
        self.started = time.monotonic()
        self.report: dict[str, Any] = {"mode": "dry" if dry else "device", "budget_s": budget_s,
                                       "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sections": {}}

    def left_s(self) -> float:
        return self.budget_s - MARGIN_S - (time.monotonic() - self.started)

    def run(self, name: str, section: Callable[["Check"], dict]) -> None:
        start = time.monotonic()
        try:
            result = section(self)
        except Exception as e:  # a failing section is reported; the next ones still run
            result = {"status": "failed", "why": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        result["seconds"] = round(time.monotonic() - start, 2)
        self.report["sections"][name] = result
        self.save()
        print(f"[device_check] {name}: {result['status']}" + (f" ({result['why']})" if result.get("why") else ""),
              flush=True)

    def save(self) -> None:
        self.report["seconds"] = round(time.monotonic() - self.started, 2)
        self.report["pngs"] = sorted(str(p.relative_to(self.out)) for p in self.out.rglob("*.png"))
        path = self.out / "device_check.json"
        path.write_text(json.dumps(self.report, indent=1, default=str))


def command(cmd: list[str], timeout_s: float, log: Path, env: Optional[dict] = None) -> tuple[int, str]:
    """Run ``cmd`` in the repository root with its output in ``log``; ``(returncode, last
    lines)``; 124 when it ran past ``timeout_s``."""
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=max(timeout_s, 1.0),
                                env={**os.environ, **(env or {})}).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, "\n".join(log.read_text(errors="replace").splitlines()[-15:])


# ---------------------------------------------------------------------- sections


def environment(check: Check) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {"status": "ran", "python": sys.version.split()[0], "torch": torch.__version__,
            "cuda_available": cuda, "cuda_version": torch.version.cuda,
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
            "flash_attn": flash_attn_version()}


def flash_attn_version() -> Optional[str]:
    try:
        import flash_attn
    except Exception:
        return None
    return getattr(flash_attn, "__version__", "unknown")


def main_job_plan(gpus: int, dry: bool) -> dict:
    """What the main-job section runs: ``{"config", "world_size", "runs"}`` (``runs``: None for
    the whole job in one launch, else the single-rank runs, one launch each) and ``why`` when
    it is not the whole job on GPUs."""
    from mindspeed_flow.train.config import load_config
    from mindspeed_flow.train.runs import RUN_NAMES

    single = [r for r in SINGLE_RANK_RUNS if r in RUN_NAMES]
    if dry:
        return {"config": DRY_CONFIG, "world_size": 1, "runs": single[:1], "steps": 1,
                "why": "dry: CPU, the CI config on 1 rank, 1 step, the baseline run only"}
    world = load_config(GPU_CONFIG).layout.world_size
    if gpus >= world:
        return {"config": GPU_CONFIG, "world_size": world, "runs": None, "steps": None, "why": None}
    return {"config": GPU_CONFIG, "world_size": 1, "runs": single, "steps": None,
            "why": f"{gpus} GPU(s): the job's {world}-rank layouts (baseline PP=2 x DP=2, the decoupled FlowTrain "
                   f"run) need {world} GPUs, one nccl rank per GPU (mindspeed_flow.spawn.cuda_usable); ran the "
                   f"single-rank runs on cuda:0 instead"}


def single_rank_config(config: Path, out: Path, data: Optional[dict] = None) -> Path:
    """``config`` on one rank (``world_size: 1``, every pipeline size 1), its ``data``
    section updated with ``data``, written under ``out``."""
    import yaml

    raw = yaml.safe_load(config.read_text())
    raw["layout"].update(world_size=1, baseline_pp=1, best_baseline_pp=None, text_only_pp=1)
    raw["data"].update(data or {})
    path = out / f"{config.stem}_1rank.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def main_job(check: Check) -> dict:
    import torch

    plan = main_job_plan(torch.cuda.device_count() if not check.dry else 0, check.dry)
    out = check.out / "main_job"
    out.mkdir(parents=True, exist_ok=True)
    # a dry run's small demo corpus lives in OUT, not in the repository's outputs/
    data = {"path": str(out / "demo_data"), "samples": 40} if check.dry else None
    config = plan["config"] if plan["runs"] is None else single_rank_config(plan["config"], out, data)
    base = [sys.executable, "-m", "mindspeed_flow.cli", "train", str(config)]
    if plan["steps"]:
        base += ["--steps", str(plan["steps"])]
    launches = [("job", [])] if plan["runs"] is None else [(r, ["--only", r, "--no-resume-check"])
                                                          for r in plan["runs"]]
    runs, skipped = {}, []
    for name, extra in launches:
        if check.left_s() < 60 and runs:
            skipped.append(name)
            continue
        report = out / name
        rc, tail = command(base + extra + ["--report", str(report)], check.left_s() - 30, out / f"{name}.log")
        runs[name] = {"returncode": rc, "report": str(report.relative_to(check.out)), **job_metrics(report)}
        if rc:
            runs[name]["log_tail"] = tail
    failed = [f"{n} (ran out of time)" if r["returncode"] == 124 else n for n, r in runs.items() if r["returncode"]]
    why = "; ".join(filter(None, [plan["why"], f"not run (out of time): {', '.join(skipped)}" if skipped else "",
                                  f"failed: {', '.join(failed)}" if failed else ""]))
    return {"status": "failed" if failed else "ran", "why": why or None, "config": str(config.relative_to(ROOT))
            if config.is_relative_to(ROOT) else str(config), "world_size": plan["world_size"], "runs": runs}


def job_metrics(report: Path) -> dict:
    """Per run of a job report: throughput, padding, peak memory, the device it ran on."""
    path = report / "metrics.json"
    if not path.exists():
        return {}
    metrics = json.loads(path.read_text())
    rows = {}
    for name, run in metrics.get("runs", {}).items():
        record = run.get("record", {})
        rows[name] = {**run.get("derived", {}), "layout": record.get("layout"), "device": record.get("device"),
                      "world_size": record.get("world_size")}
    return {"metrics": rows, "parity": metrics.get("parity"), "resume": metrics.get("resume")}


def attention(check: Check) -> dict:
    out = check.out / "attention"
    out.mkdir(parents=True, exist_ok=True)
    install = None if check.dry or flash_attn_version() else try_flash_attn_install(out)
    if check.dry:
        args = ["--device", "cpu", "--sizes", "256", "--patches", "32", "--heads", "2", "--head-dim", "16"]
    else:
        args = ["--device", "cuda", "--dtype", "bfloat16", "--sizes", "8192", "32768", "--backward-up-to", "32768",
                "--repeats", "3", "--heads", "16", "--head-dim", "128", "--patches", "16384"]
    result_json = out / "bench_attention.json"
    rc, tail = command([sys.executable, str(ROOT / "scripts" / "device_attention.py"), *args,
                        "--json", str(result_json)], min(150.0, check.left_s()), out / "bench_attention.log")
    if rc:
        return {"status": "failed", "why": f"bench_attention exited {rc}", "log_tail": tail, "flash_attn_install": install}
    result = json.loads(result_json.read_text())
    draw_attention(result, out / "attention.png")
    backend = result["settings"]["varlen_backend"]
    why = None if backend == "flash_attn" or check.dry else (
        f"varlen ran on {backend}: flash-attn is not importable ({install or 'not installed'})")
    return {"status": "ran", "why": why, "varlen_backend": backend, "flash_attn_install": install,
            "cases": result["attention"], "patch_embed": result["patch_embed"]}


def try_flash_attn_install(out: Path) -> str:
    """``pip install`` flash-attn from ``$FLASH_ATTN_WHEEL`` or, wheels only, from the index."""
    wheel = os.environ.get("FLASH_ATTN_WHEEL")
    target = [wheel] if wheel else ["--only-binary=:all:", "flash-attn"]
    rc, tail = command([sys.executable, "-m", "pip", "install", "--retries", "0", "--timeout", "15", *target],
                       FLASH_ATTN_INSTALL_S, out / "flash_attn_install.log")
    return "installed" if rc == 0 and flash_attn_version() else f"pip install failed (exit {rc}): {tail[-300:]}"


def draw_attention(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = result["attention"]
    names = [c["name"] for c in cases] + ["patch embed fwd+bwd"]
    dense = [c["dense_s"] for c in cases] + [result["patch_embed"]["conv3d_fwd_bwd_s"]]
    ours = [c["varlen_s"] for c in cases] + [result["patch_embed"]["matmul_fwd_bwd_s"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], dense, 0.4, label="dense mask / Conv3d")
    ax.bar([i + 0.2 for i in x], ours, 0.4, label=f"varlen ({result['settings']['varlen_backend']}) / Matmul")
    ax.set_xticks(list(x), names, rotation=15)
    ax.set_ylabel("seconds (best of repeats)")
    ax.set_title(f"attention and patch embedding on {result['settings']['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def real_compute_bench(script: str, ranks: int, what: str, extra_check: Callable[[str], Optional[str]] = None):
    """A section for a multi-rank benchmark that needs a real-compute mode (a ``--device``
    option) and ``ranks`` GPUs; ``extra_check(source)`` names a missing part (or None)."""

    def section(check: Check) -> dict:
        import torch

        source = (ROOT / "scripts" / script).read_text()
        missing = extra_check(source) if extra_check else None
        if '"--device"' not in source:
            return {"status": "not_available", "why": f"not available in this version: scripts/{script} has no "
                    f"real-compute mode (no --device option: device time is emulated with sleeps on gloo CPU "
                    f"ranks); {what} with real compute needs one", **({"also": missing} if missing else {})}
        gpus = torch.cuda.device_count()
        if not check.dry and gpus < ranks:
            return {"status": "skipped", "why": f"needs {ranks} GPUs (one nccl rank per GPU), this machine has {gpus}"}
        out = check.out / script.removesuffix(".py")
        out.mkdir(parents=True, exist_ok=True)
        args = ["--device", "cpu" if check.dry else "cuda", "--steps", "1"]
        rc, tail = command([sys.executable, str(ROOT / "scripts" / script), *args], min(150.0, check.left_s()),
                           out / "run.log")
        return {"status": "failed" if rc else "ran", "why": missing, "returncode": rc, "log_tail": tail}

    return section


def flow_layout_missing(source: str) -> Optional[str]:
    """What is missing for the flow layout's real-compute comparison (None: nothing).  The flow
    layout may come as a layout of bench_decoupled (``source``) or as ``scripts/bench_flow.py``."""
    if '"flow"' in source:
        return None
    bench_flow = ROOT / "scripts" / "bench_flow.py"
    if not bench_flow.exists():
        return ("the flow layout: not available in this version (scripts/bench_decoupled.py runs stage0, "
                "decoupled-1 and decoupled-2 only, and there is no scripts/bench_flow.py)")
    if '"--device"' not in bench_flow.read_text():
        return ("the flow layout: scripts/bench_flow.py has it with emulated compute only (no --device option), "
                "so it is not run on the device")
    return "the flow layout: scripts/bench_flow.py has a --device option, which this device check does not run yet"


SECTION_FUNCS: dict[str, Callable[[Check], dict]] = {
    "environment": environment,
    "main_job": main_job,
    "attention": attention,
    "schedule": real_compute_bench("bench_schedule.py", 4, "the executor vs megatron-core's 1F1B step time"),
    "decoupled": real_compute_bench("bench_decoupled.py", 4, "decoupled and flow vs the baselines",
                                    flow_layout_missing),
}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder for device_check.json, the PNGs and the logs")
    parser.add_argument("--dry", action="store_true", default=os.environ.get("DEVICE_CHECK_DRY") == "1",
                        help="CPU, tiny config and counts (what CI runs; also DEVICE_CHECK_DRY=1)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="time for the whole check")
    args = parser.parse_args(argv)
    import torch

    if not args.dry and not torch.cuda.is_available():
        raise NoCuda("device_check: no CUDA device on this machine (torch.cuda.is_available() is False, torch "
                     f"{torch.__version__}); the device check needs a CUDA GPU. Use --dry (or DEVICE_CHECK_DRY=1) "
                     "for the CPU dry run.")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry:  # a dry run's job report and corpus are small; an earlier dry run's are replaced
        shutil.rmtree(args.out / "main_job", ignore_errors=True)
    check = Check(args.out.resolve(), args.dry, args.budget_s)
    for name in SECTIONS:
        check.run(name, SECTION_FUNCS[name])
    print(f"[device_check] report: {check.out / 'device_check.json'} ({check.report['seconds']:.0f} s)")
    return 1 if any(s["status"] == "failed" for s in check.report["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
