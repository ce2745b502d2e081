"""Run Python in a fresh interpreter: import hooks, ``.pth`` files and first imports can only
be observed in a process that has not imported anything yet."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any, Mapping, Sequence


def run_python(code: str, args: Sequence[str] = (), env: Mapping[str, str] | None = None,
               timeout: float = 180, cwd: str | None = None) -> subprocess.CompletedProcess:
    """``python -c CODE ARGS`` with this interpreter; the environment minus plugin switches."""
    environ = {k: v for k, v in os.environ.items() if k != "MINDSPEED_FLOW_FLAGS"}
    environ.update(env or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True,
                          text=True, timeout=timeout, env=environ, cwd=cwd)


def last_json(proc: subprocess.CompletedProcess) -> Any:
    """The JSON document on the last stdout line; fails with the child's output otherwise."""
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
