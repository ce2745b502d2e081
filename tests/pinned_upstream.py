"""The pinned upstream sources for tests: unpacked by the project's own ``unpack.sh``.

Tests never rely on a checkout existing on the machine: :func:`unpack` runs
``<repo>/../shared/upstream/unpack.sh`` into a directory the test owns (a pytest temp dir)
and returns the three source roots.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

UNPACK = Path(__file__).resolve().parent.parent.parent / "shared" / "upstream" / "unpack.sh"


def unpack(directory: Path) -> dict[str, str]:
    """``{"MEGATRON_LM_SRC": ..., "MINDSPEED_SRC": ..., "MINDSPEED_MM_SRC": ...}`` of the
    sources unpacked into ``directory`` (MindSpeed-MM's root holds Megatron's ``megatron/``)."""
    if not UNPACK.is_file():
        raise FileNotFoundError(f"{UNPACK} is missing: the pinned upstream sources sit next to the repository")
    out = subprocess.run(["bash", str(UNPACK), str(directory)], capture_output=True, text=True, check=True).stdout
    env = {}
    for line in out.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        env[key] = value
    return env
