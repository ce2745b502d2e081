"""Switching the plugin on: the zero-edit ``.pth`` hook and ``python -m mindspeed_flow.launch``.

Each case runs a fresh interpreter, since the hook acts at interpreter start-up."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from subprocess_utils import last_json, run_python

from mindspeed_flow.activation import job_notes
from mindspeed_flow.config import FlowConfig

PROBE = '''
import json, sys
from importlib import import_module
loaded = sorted(m for m in sys.modules if m.startswith("mindspeed_flow"))
active = None
if "mindspeed_flow.activation" in sys.modules:
    registry = import_module("mindspeed_flow.activation").current_registry()
    active = sorted(registry.enabled) if registry else None
print(json.dumps({"loaded": loaded, "enabled": active}))
'''


def expected(requested):
    """What activation enables: core plus the requested features that have patches
    ("all": what --use-flowtrain turns on, which leaves the allocator off without a plan)."""
    from mindspeed_flow.config import FlowConfig
    from mindspeed_flow.patches import all_patches

    declared = {p.feature for p in all_patches()}
    if requested == "all":
        requested = FlowConfig.from_argv(["--use-flowtrain"], environ={}).features
    requested = set(requested)
    return sorted(({"core"} | requested) & declared)


def probe(args=(), env=None):
    return last_json(run_python(PROBE, args, env=env))


def test_the_activation_hook_is_installed_next_to_the_package():
    site = Path(sysconfig.get_paths()["purelib"])
    line = (site / "mindspeed_flow_autoload.pth").read_text()
    assert line.startswith("import ") and "mindspeed_flow.launch" in line


def test_without_flags_nothing_of_the_plugin_is_imported():
    assert probe(["--num-layers", "2"]) == {"loaded": [], "enabled": None}
    assert probe(["--no-flow-packing"]) == {"loaded": [], "enabled": None}


def test_flag_on_an_unchanged_command_line_activates():
    out = probe(["--num-layers", "2", "--use-flowtrain", "--no-flow-pool"])
    assert out["enabled"] == expected(set(expected("all")) - {"pool"})
    assert "mindspeed_flow.patches.core" in out["loaded"]


def test_environment_variable_activates_like_the_flag():
    run = run_python(PROBE, env={"MINDSPEED_FLOW_FLAGS": "--flow-packing --flow-pool"})
    # packing brings the varlen attention it needs (fused_attn); pool's patches are the
    # decoupled layout's (pass-through without one)
    assert last_json(run)["enabled"] == expected({"packing", "fused_attn", "pool"}) == \
        ["core", "fused_attn", "packing", "pool"]
    assert "no patches" not in run.stderr


REFUSING_PROBE = PROBE.replace("import json, sys", "import json, sys\nprint('the script ran')")


@pytest.mark.parametrize("flags", [["--flow-packing", "--no-flow-fused-attn"],
                                   ["--use-flowtrain", "--no-flow-fused-attn"]])
def test_packing_without_varlen_attention_refuses_to_start_naming_both_flags(tmp_path, flags):
    """(issue 19, defect 2) On the zero-edit path (the .pth hook: site would print an
    exception and run the job without the plugin) and through the launcher, the process
    exits 2 before the script runs, with one line naming both flags."""
    script = tmp_path / "train.py"
    script.write_text(REFUSING_PROBE)
    for command in ([sys.executable, str(script), *flags],
                    [sys.executable, "-m", "mindspeed_flow.launch", str(script), *flags]):
        proc = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert "the script ran" not in proc.stdout
        refusal = [line for line in proc.stderr.splitlines() if line.startswith("mindspeed-flow: refusing to start:")]
        assert len(refusal) == 1 and "--no-flow-fused-attn with --flow-packing" in refusal[0], proc.stderr
        assert "Traceback" not in proc.stderr


def test_launcher_runs_a_script_as_main_with_the_plugin_active(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(PROBE.replace('print(json.dumps({', 'print(json.dumps({"argv": sys.argv, "name": __name__, '))
    proc = run_python("from mindspeed_flow.launch import main; main()", [str(script), "--lr", "0.1"])
    out = last_json(proc)
    assert out["argv"] == [str(script), "--lr", "0.1"]
    assert out["name"] == "__main__"
    assert out["enabled"] == ["core"]


def test_launcher_runs_a_module_and_explains_its_usage(tmp_path):
    (tmp_path / "trainer_mod.py").write_text(PROBE)
    out = last_json(run_python("from mindspeed_flow.launch import main; main()",
                               ["-m", "trainer_mod", "--flow-fused-attn"], env={"PYTHONPATH": str(tmp_path)}))
    assert out["enabled"] == expected({"fused_attn"}) == ["core", "fused_attn"]
    bare = run_python("import runpy; runpy.run_module('mindspeed_flow.launch', run_name='__main__')")
    assert bare.returncode == 2 and "usage: python -m mindspeed_flow.launch" in bare.stdout


def test_python_dash_m_launch_with_the_flag_also_seen_by_the_hook(tmp_path):
    """Both the .pth hook and the launcher activate here: activation must be idempotent."""
    script = tmp_path / "train.py"
    script.write_text(PROBE)
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.launch", str(script), "--use-flowtrain"],
                          capture_output=True, text=True, timeout=120)
    assert last_json(proc)["enabled"] == expected("all")
    assert "no patches" not in proc.stderr  # pool and system swap nothing by design: the job log says what they did


def test_under_torchrun_each_worker_runs_the_script_with_the_plugin_active(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(PROBE.replace('print(json.dumps({', 'import os\nprint(json.dumps({"rank": os.environ["RANK"], '))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-addr", "127.0.0.1", "--master-port", "0",
                           "-m", "mindspeed_flow.launch", str(script), "--flow-packing"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line[line.index("{"):]) for line in proc.stdout.splitlines() if '"rank"' in line]
    assert sorted(line["rank"] for line in lines) == ["0", "1"]
    assert all(line["enabled"] == expected({"packing", "fused_attn"}) for line in lines)


JOB_NOTES_PROBE = '''
import json, sys
from mindspeed_flow.activation import job_notes
from mindspeed_flow.config import FlowConfig
print(json.dumps(job_notes(FlowConfig.from_argv(sys.argv[1:]))))
'''


def test_the_job_log_says_what_pool_and_system_did():
    """(issue 19, defect 6) system swaps no upstream function and pool's patches act only
    under a decoupled layout: the job's log says what they did in this job (pool: no pool
    without a decoupled layout, and why; system: the binding and variables it set), never
    "no patches in this version"."""
    pool, system = last_json(run_python(JOB_NOTES_PROBE, ["--use-flowtrain"]))
    assert pool.startswith("pool: no pool opened (backend shm unused)")
    assert "co-located" in pool and "decoupled layout" in pool
    assert system.startswith("system: bound local rank 0: cores ") and "Ascend environment defaults:" in system
    assert last_json(run_python(JOB_NOTES_PROBE, ["--flow-packing"])) == []
    opened = job_notes(FlowConfig.from_argv(["--flow-pool-backend", "torch"], environ={}), "encoder dp 1, 3 ranks")
    assert opened == ["pool: backend torch, one pool per slice of the decoupled layout (encoder dp 1, 3 ranks)"]
    # flags parsed later (Megatron's args) but the process activated without --flow-system
    late = run_python(JOB_NOTES_PROBE.replace("sys.argv[1:]", '["--flow-system"]'))
    assert last_json(late) == ["system: nothing set in this process (it acts when the plugin activates, before "
                               "upstream is imported, and this process activated it without --flow-system)"]
