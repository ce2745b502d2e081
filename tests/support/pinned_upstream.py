"""The pinned upstream sources (``shared/upstream``), unpacked once into a cache folder.

Megatron-LM core_v0.12.1, MindSpeed 028de58 and MindSpeed-MM 57069cd live as archives in
the shared folder beside the repository; ``unpack.sh`` lays them out as MindSpeed-MM's
installer does.  Tests against upstream source use :func:`upstream_sources`, and
``tests/conftest.py`` points ``MEGATRON_LM_SRC`` / ``MINDSPEED_SRC`` / ``MINDSPEED_MM_SRC`` at
them when they are unset, so a clean machine runs those tests on the pinned sources.

Environment overrides: ``MINDSPEED_FLOW_SHARED`` (the shared folder, default
``<repo>/../shared``), ``MINDSPEED_FLOW_UPSTREAM_CACHE`` (default
``~/.cache/mindspeed-flow/upstream``).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV_NAMES = ("MEGATRON_LM_SRC", "MINDSPEED_SRC", "MINDSPEED_MM_SRC")


@dataclass(frozen=True)
class Sources:
    """The unpacked checkouts; MindSpeed-MM holds Megatron's ``megatron/`` copy in its root."""

    megatron_lm: Path
    mindspeed: Path
    mindspeed_mm: Path

    def env(self) -> dict[str, str]:
        return dict(zip(ENV_NAMES, map(str, (self.megatron_lm, self.mindspeed, self.mindspeed_mm))))


def shared_dir() -> Path:
    return Path(os.environ.get("MINDSPEED_FLOW_SHARED", REPO.parent / "shared")).resolve()


def _archives_key(upstream: Path) -> str:
    """Names and sizes of the archives: a new pin unpacks into a new folder."""
    entries = sorted(f"{p.name}:{p.stat().st_size}" for p in upstream.iterdir() if p.is_file())
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def upstream_sources() -> Sources:
    """Unpack the pinned sources (once per archive set, under a lock) and return them."""
    upstream = shared_dir() / "upstream"
    script = upstream / "unpack.sh"
    if not script.is_file():
        raise FileNotFoundError(
            f"{script} not found: the pinned upstream sources live in the shared folder beside "
            "the repository; set MINDSPEED_FLOW_SHARED to that folder")
    cache = Path(os.environ.get("MINDSPEED_FLOW_UPSTREAM_CACHE",
                                Path.home() / ".cache" / "mindspeed-flow" / "upstream"))
    target = cache / _archives_key(upstream)
    target.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{target.name}.lock", "w") as lock:  # concurrent test runs unpack once
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run(["bash", str(script), str(target)], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"bash {script} {target} failed ({proc.returncode}):\n{proc.stderr}")
    exported = dict(word.split("=", 1) for word in proc.stdout.split() if "=" in word)
    missing = [name for name in ENV_NAMES if name not in exported]
    if missing:
        raise RuntimeError(f"{script} printed no {', '.join(missing)}:\n{proc.stdout}")
    return Sources(*(Path(exported[name]) for name in ENV_NAMES))


def export_defaults(environ: dict | None = None) -> dict[str, str]:
    """Set each unset ``*_SRC`` variable to the pinned checkout; returns what was set."""
    environ = os.environ if environ is None else environ
    if all(environ.get(name) for name in ENV_NAMES):
        return {}
    chosen = {k: v for k, v in upstream_sources().env().items() if not environ.get(k)}
    environ.update(chosen)
    return chosen
