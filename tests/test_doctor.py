"""``mindspeed-flow doctor``: real statuses against the installed megatron-core, a source tree,
and (when named by environment variables) upstream checkouts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from mindspeed_flow.doctor import check_sources
from mindspeed_flow.patches import all_patches
from subprocess_utils import run_python

DOCTOR_WITH_PATCHES = '''
import sys
from mindspeed_flow.activation import deactivate
deactivate()  # a --flow-* argument made the .pth hook activate the real declarations: start over
import mindspeed_flow.patches as declared
from mindspeed_flow.patching import Patch
def noop(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)
S = "megatron.core.pipeline_parallel.schedules"
declared.all_patches = lambda: [
    Patch("schedule", S + ":get_forward_backward_func", wrapper=noop, params=""),
    Patch("schedule", S + ":forward_backward_no_pipelining", wrapper=noop, params="*, forward_step_func, model"),
    Patch("fused_attn", S + ":get_forward_backward_func_v2", wrapper=noop),
    Patch("fused_attn", S + ":forward_backward_no_pipelining", wrapper=noop, params="forward_step_func"),
    Patch("packing", "megatron.core.no_such_module:build", wrapper=noop),
    Patch("packing", "mindspeed_mm.data:build_mm_dataloader", wrapper=noop),
    Patch("allocator", S + ":gone_but_optional", wrapper=noop, optional=True),
]
from mindspeed_flow.cli import main
sys.exit(main(sys.argv[1:]))
'''


def doctor(args):
    proc = run_python(DOCTOR_WITH_PATCHES, args)
    rows = json.loads(proc.stdout[proc.stdout.index("["):])
    return proc.returncode, {(r["feature"], r["target"].split(":")[1]): r for r in rows}


def test_doctor_reports_real_statuses_against_installed_megatron_core():
    code, rows = doctor(["doctor", "--json"])
    status = {key: row["status"] for key, row in rows.items() if key[0] != "pool"}  # pool: see below
    assert status == {
        ("schedule", "get_forward_backward_func"): "found",
        ("schedule", "forward_backward_no_pipelining"): "found",
        ("fused_attn", "get_forward_backward_func_v2"): "missing",
        ("fused_attn", "forward_backward_no_pipelining"): "signature changed",
        ("packing", "build"): "missing",
        ("packing", "build_mm_dataloader"): "not installed",
        ("allocator", "gone_but_optional"): "missing",
    }
    assert code == 1  # required targets are missing
    changed = rows[("fused_attn", "forward_backward_no_pipelining")]
    assert "expected (forward_step_func), found (*, forward_step_func" in changed["detail"]
    assert changed["version"].startswith("megatron-core 0.")
    assert rows[("allocator", "gone_but_optional")]["failure"] is False


DOCTOR_WITHOUT_MOONCAKE_MASTER = '''
import sys
import mindspeed_flow.pool.mooncake as mooncake
mooncake.master_binary = lambda: None  # as on a machine where mooncake_master is not installed
from mindspeed_flow.cli import main
sys.exit(main(sys.argv[1:]))
'''


def test_doctor_json_has_a_row_per_pool_backend():
    """``--flow-pool-backend`` choices: a row each, saying whether it can run here and why
    not; none is a failure.  (``--feature schedule`` above leaves them out.)"""
    from mindspeed_flow.pool import BACKENDS

    proc = run_python(DOCTOR_WITHOUT_MOONCAKE_MASTER, ["doctor", "--json"])
    every = json.loads(proc.stdout[proc.stdout.index("["):])
    rows = {r["target"]: r for r in every if r["feature"] == "pool" and r["target"].startswith("mindspeed_flow.pool:")}
    assert list(rows) == [f"mindspeed_flow.pool:{b}" for b in BACKENDS]
    # and the pool feature's patches (the decoupled layout's) have rows of their own
    assert {r["target"] for r in every if r["feature"] == "pool"} - set(rows) >= {
        "megatron.training.arguments:validate_args", "mindspeed_mm.models.vlm_model:VLMModel.__init__"}
    assert all(set(r) == set(every[0]) and r["failure"] is False for r in rows.values())
    assert rows["mindspeed_flow.pool:local"]["status"] == "available"
    mooncake = rows["mindspeed_flow.pool:mooncake"]
    assert mooncake["status"] == "unavailable"
    assert "mooncake_master is not on PATH" in mooncake["detail"] or "cannot import mooncake.store" in mooncake["detail"]
    if not os.path.isdir("/usr/local/Ascend/driver"):
        assert rows["mindspeed_flow.pool:memfabric"]["status"] == "unavailable"
        assert "no Ascend driver" in rows["mindspeed_flow.pool:memfabric"]["detail"]


def test_doctor_with_flags_applies_and_says_applied():
    code, rows = doctor(["doctor", "--json", "--feature", "schedule", "--flow-schedule"])
    assert {k[1]: r["status"] for k, r in rows.items()} == {
        "get_forward_backward_func": "applied", "forward_backward_no_pipelining": "applied"}
    assert code == 0


def test_doctor_exit_code_zero_when_every_required_target_is_fine():
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "doctor"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "megatron.training.arguments:parse_args" in proc.stdout
    assert "0 required target(s) missing or changed" in proc.stdout


def test_console_script_is_installed():
    script = Path(sysconfig.get_paths()["scripts"]) / "mindspeed-flow"
    proc = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("mindspeed-flow ")


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def test_doctor_src_reads_a_checkout_without_importing_it(tmp_path):
    tree = write_tree(tmp_path / "Megatron-LM", {
        "megatron/__init__.py": "",
        "megatron/training/__init__.py": "import this_module_does_not_exist  # never executed\n",
        "megatron/training/arguments.py": '''
            import torch_npu  # never executed
            def parse_args(extra_args_provider=None, ignore_unknown_args=False):
                pass
            def validate_args(config, defaults={}):
                pass
        ''',
    })
    rows = {r.target: r for r in check_sources(all_patches(), [tree])}
    assert rows["megatron.training.arguments:parse_args"].status == "found"
    assert "arguments.py:3" in rows["megatron.training.arguments:parse_args"].detail
    changed = rows["megatron.training.arguments:validate_args"]
    assert changed.status == "signature changed" and changed.is_failure
    assert "expected (args, defaults), found (config, defaults)" in changed.detail
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "doctor", "--src", str(tree)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "signature changed" in proc.stdout


UPSTREAM_CHECKOUTS = ["MEGATRON_LM_SRC", "MINDSPEED_SRC", "MINDSPEED_MM_SRC"]


def doctor_src_rows(root: Path) -> tuple[int, list[dict]]:
    """``mindspeed-flow doctor --src ROOT --json``, as a user would run it."""
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "doctor", "--json", "--src", str(root)],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout)


def assert_every_present_target_fits(root: Path) -> int:
    code, rows = doctor_src_rows(root)
    present = [r for r in rows if r["status"] != "not installed"]
    failures = [f"{r['target']}: {r['status']} ({r['detail']})" for r in present if r["status"] != "found"]
    assert not failures, "\n".join(failures)
    assert code == 0
    return len(present)


def test_contract_against_the_installed_megatron_core():
    """Read from the installed megatron-core's files, every megatron.core target is there."""
    from mindspeed_flow.patching.source import installed_roots

    (root,) = {r for r in installed_roots("megatron") if (r / "megatron" / "core").is_dir()}
    present = assert_every_present_target_fits(root)
    expected = {p.target for p in all_patches() if p.module.startswith("megatron.core.")}
    assert expected and present >= len(expected)


@pytest.mark.parametrize("variable", UPSTREAM_CHECKOUTS)
def test_contract_against_upstream_checkout(variable):
    """Every declared patch whose module the checkout holds is found with a fitting signature."""
    root = os.environ.get(variable)
    if not root:
        pytest.skip(f"{variable} is not set: no upstream checkout to check the patch targets against")
    print(f"{variable}={root}: {assert_every_present_target_fits(Path(root))} target(s) found")
