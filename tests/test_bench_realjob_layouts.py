"""scripts/bench_realjob_layouts.py's ``hetero-parallel`` and ``flow`` rows without running a
real job (a dry check, so the rows cannot rot between the runs made by hand, docs/decoupled.md,
docs/flow.md).  The flow row runs the decoupled row's ranks with ``flow_layout.yaml`` and is
compared with the decoupled (lockstep) row; the hetero-parallel row
runs ``tests/upstream/test_real_job_hetero.HETERO`` as is, with only the bench's iterations,
environment and timeout changed; it has no simulator prediction, its note says what the
pinned code forces, and its step-time ratios are given only where its logged global batch is
upstream's."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    path = list(sys.path)
    spec = importlib.util.spec_from_file_location("bench_realjob_layouts", ROOT / "scripts" / "bench_realjob_layouts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports tests/upstream's harness modules: no upstream code, no job
    yield module
    sys.path[:] = path  # the script puts tests/upstream and tests/support first
    sys.modules.pop("bench_realjob_layouts", None)


def test_the_hetero_row_runs_upstreams_hetero_job_as_is(bench):
    from test_real_job_hetero import HETERO

    env = (("REALJOB_MODULE_TIMES", "1"),)
    job = bench.row_job("hetero-parallel", 5, env, 123)
    assert job == dataclasses.replace(HETERO, iters=5, env=env, timeout_s=123)
    assert "--hetero-parallel" in job.extra_args and job.plugin == ()  # upstream's own flag, no plugin
    assert bench.row_job("upstream", 5, env, 123).extra_args == ()


def test_the_hetero_row_is_labelled_and_has_no_simulator_prediction(bench):
    assert "hetero-parallel" not in bench.SIMULATED
    note = bench.NOTES["hetero-parallel"]
    assert "FROZEN" in note and "no simulator prediction" in note


def _cells(line: str) -> list[str]:
    return line.split()


def test_step_ratios_only_against_the_same_logged_global_batch(bench):
    upstream = {"step_s": 2.0, "samples_per_s": 2.0, "global_batch": 4}
    colocated = {"step_s": 1.0, "samples_per_s": 4.0, "global_batch": 4}
    hetero = {"step_s": 4.0, "samples_per_s": 1.0, "global_batch": 4}
    cells = _cells(bench.table_line("real", "hetero-parallel", hetero, upstream, colocated))
    assert cells[:6] == ["real", "hetero-parallel", "4.000", "0.50x", "0.25x", "1.00"]
    assert cells[6] == "0.50x" and [math.isnan(float(c)) for c in cells[7:]] == [True, True]
    rescaled = dict(hetero, global_batch=8)  # a global batch unlike upstream's: samples/s compares, steps do not
    cells = _cells(bench.table_line("real", "hetero-parallel", rescaled, upstream, colocated))
    assert cells[3:5] == ["nanx", "nanx"] and cells[6] == "0.50x"


def test_the_flow_row_runs_the_decoupled_rows_ranks_with_the_flow_layout(bench):
    import yaml

    env = (("REALJOB_MODULE_TIMES", "1"),)
    flow, decoupled = bench.row_job("flow", 5, env, 123), bench.row_job("decoupled", 5, env, 123)
    assert (flow.pp, flow.world_size, flow.iters, flow.env, flow.timeout_s) == (
        decoupled.pp, decoupled.world_size, 5, env, 123)
    assert flow.plugin[:-1] == decoupled.plugin[:-1] and flow.plugin[-2] == "--flow-schedule-config"
    layout = yaml.safe_load(Path(flow.plugin[-1]).read_text())["decoupled"]
    assert layout["flow"] is True and not yaml.safe_load(Path(decoupled.plugin[-1]).read_text())["decoupled"].get("flow")
    assert {k: v for k, v in layout.items() if k.startswith(("encoder", "backbone"))} == {
        k: v for k, v in yaml.safe_load(Path(decoupled.plugin[-1]).read_text())["decoupled"].items()
        if k.startswith(("encoder", "backbone"))}  # the same ranks as the decoupled row


def test_the_flow_row_has_no_simulator_prediction_and_says_so(bench):
    assert "flow" in bench.LAYOUTS and "flow" not in bench.SIMULATED
    assert "no simulator prediction" in bench.NOTES["flow"]
    decoupled = {"step_s": 2.0, "samples_per_s": 2.0, "global_batch": 4}
    flow = {"step_s": 1.6, "samples_per_s": 2.5, "global_batch": 4}
    cells = _cells(bench.table_line("emulated", "flow", flow, decoupled, None))
    assert cells[:4] == ["emulated", "flow", "1.600", "1.25x"] and math.isnan(float(cells[-1]))
    assert bench.flow_vs_decoupled({"flow": flow, "decoupled": decoupled}) == pytest.approx(1.25)
    assert bench.flow_vs_decoupled({"flow": flow}) is None
    assert bench.flow_vs_decoupled({"flow": dict(flow, global_batch=8), "decoupled": decoupled}) is None
