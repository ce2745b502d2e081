"""``python -m mindspeed_flow.launch SCRIPT`` behaves like ``python SCRIPT`` (issue 8, defect 2),
and the start-up source check sees upstream that sits beside the script (defect 6).

MindSpeed-MM keeps Megatron's ``megatron/`` copy in its root, beside ``pretrain_vlm.py``:
launched from another folder, that copy is importable only if the script's folder is on
``sys.path`` first, and the plugin's start-up check of its patch targets can only read it
then.  When the plugin is switched on before that folder is on ``sys.path`` (the ``.pth``
hook runs at interpreter start-up), the check waits for the package's import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mindspeed_flow.patching import Patch, PatchError, PatchRegistry
from subprocess_utils import last_json

SCRIPT = """
    import json, sys
    import sibling_module
    print(json.dumps({"path0": sys.path[0], "argv": sys.argv, "value": sibling_module.VALUE}))
"""


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_launch_puts_the_script_folder_first_like_python_script(tmp_path):
    script = write(tmp_path / "job" / "train.py", SCRIPT)
    write(tmp_path / "job" / "sibling_module.py", "VALUE = 42\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    direct = last_json(run([str(script), "--lr", "1"], elsewhere))
    launched = last_json(run(["-m", "mindspeed_flow.launch", str(script), "--lr", "1"], elsewhere))
    assert launched == direct
    assert Path(launched["path0"]) == script.parent.resolve()


def test_launch_checks_upstream_beside_the_script_before_the_script_runs(tmp_path):
    """A Megatron copy beside the script whose ``parse_args`` was renamed: the launcher
    refuses at start-up, naming the target, before the script's first line."""
    job = tmp_path / "MindSpeed-MM"
    write(job / "megatron" / "__init__.py", "")
    write(job / "megatron" / "training" / "__init__.py", "")
    write(job / "megatron" / "training" / "arguments.py", """
        def parse_args_renamed(extra_args_provider=None, ignore_unknown_args=False):
            pass

        def validate_args(args, defaults={}):
            pass
    """)
    script = write(job / "pretrain_vlm.py", """
        print("script started")
        import megatron.training.arguments
    """)
    proc = run(["-m", "mindspeed_flow.launch", str(script)], tmp_path)
    assert proc.returncode != 0
    assert "script started" not in proc.stdout
    assert "megatron.training.arguments:parse_args" in proc.stderr
    assert "missing" in proc.stderr


@pytest.fixture
def late_package(tmp_path, monkeypatch):
    """A package that is not on ``sys.path`` when the plugin is switched on."""
    root = tmp_path / "late"
    write(root / "msf_late_pkg" / "__init__.py", "")
    write(root / "msf_late_pkg" / "mod.py", "def present(x):\n    return x\n")
    yield root
    for name in ("msf_late_pkg", "msf_late_pkg.mod"):
        sys.modules.pop(name, None)


def test_a_deferred_source_check_runs_when_the_package_becomes_importable(late_package, monkeypatch):
    registry = PatchRegistry([Patch(feature="f", target="msf_late_pkg.mod:absent", wrapper=lambda w, i, a, k: w(*a, **k))])
    registry.enable({"f"})  # nothing to read yet: no error, and the report says why
    (row,) = registry.report()
    assert row.status == "pending" and "source not checked yet" in row.detail and "msf_late_pkg" in row.detail
    monkeypatch.syspath_prepend(str(late_package))
    with pytest.raises(PatchError, match="msf_late_pkg.mod:absent"):
        import msf_late_pkg  # noqa: F401  (the check runs at the package's import)
    assert "msf_late_pkg.mod" not in sys.modules  # refused before the target module is imported
    registry.remove()


def test_a_deferred_check_that_passes_lets_the_patch_apply(late_package, monkeypatch):
    calls = []

    def wrapper(wrapped, instance, args, kwargs):
        calls.append(args)
        return wrapped(*args, **kwargs)

    registry = PatchRegistry([Patch(feature="f", target="msf_late_pkg.mod:present", wrapper=wrapper, params="x")])
    registry.enable({"f"})
    monkeypatch.syspath_prepend(str(late_package))
    import msf_late_pkg.mod

    assert msf_late_pkg.mod.present(3) == 3 and calls == [(3,)]
    assert registry.report()[0].status == "applied"
    registry.remove()
