"""What to do when a child process that imports an upstream source checkout fails on a
missing module.

Some upstream code cannot be imported on a CPU-only machine at all: Megatron-LM after
core_v0.12 imports ``triton`` unconditionally (reached from
``megatron/core/pipeline_parallel/schedules.py``), and triton has no CPU build.  A test run
against such a checkout is skipped with that reason.  Any other missing module is a gap in
this project's test environment, and the test fails saying which module, imported where,
and how to install it, instead of ending in the child's traceback.
"""

from __future__ import annotations

import re
import subprocess

import pytest

# Modules that exist only with a GPU toolchain: a checkout needing them cannot run here.
DEVICE_ONLY_MODULES = {"triton": "triton has no CPU build (it compiles GPU kernels)"}

_MISSING = re.compile(r"No module named '([\w.]+)'")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def importing_line(stderr: str, root: str) -> str:
    """``path:line`` of the last traceback frame inside ``root`` (where the import sits)."""
    frames = [f"{path}:{line}" for path, line in _FRAME.findall(stderr) if path.startswith(str(root))]
    return frames[-1] if frames else "an import outside the checkout"


def require_importable(proc: subprocess.CompletedProcess, root: str) -> None:
    """Return if the child succeeded or failed for another reason; otherwise skip (module
    that cannot exist here) or fail clearly (module missing from the test environment)."""
    if proc.returncode == 0:
        return
    found = _MISSING.search(proc.stderr)
    if found is None:
        return
    module = found.group(1)
    where = importing_line(proc.stderr, root)
    top = module.split(".")[0]
    if top in DEVICE_ONLY_MODULES:
        pytest.skip(f"{root} imports {top} unconditionally ({where}); {DEVICE_ONLY_MODULES[top]}, "
                    "so this checkout cannot be imported on this machine")
    pytest.fail(f"{root} needs the Python module {module!r} ({where}), which this environment lacks; "
                "install the test extra (pip install -e '.[test]') or add it there", pytrace=False)
