"""Suite-wide setup: the upstream-source tests run on the pinned sources by default.

``MEGATRON_LM_SRC`` / ``MINDSPEED_SRC`` / ``MINDSPEED_MM_SRC`` that are unset are pointed at
the checkouts unpacked from ``shared/upstream`` (see ``pinned_upstream.py``) before test
modules are collected (some read them at import).  A variable set by the caller wins.

Layout: ``tests/<package>/test_<module>.py`` mirrors the package tree (``tests/adapters/<upstream>/``
for the adapters); ``tests/support/`` holds what tests share; ``tests/upstream/`` runs the real
upstream jobs (MindSpeed, MindSpeed-MM) and needs the environment of ``scripts/test_upstream.sh``.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The tests' harnesses, models and stand-ins (``tests/support``) are imported by their bare
# module names, from the test modules and from the child processes some tests start.
SUPPORT = str(Path(__file__).resolve().parent / "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

from pinned_upstream import export_defaults  # noqa: E402


def pytest_configure(config) -> None:
    export_defaults()


def pytest_report_header(config) -> str:
    import os

    return "upstream sources: " + ", ".join(f"{n}={os.environ.get(n, '-')}" for n in
                                              ("MEGATRON_LM_SRC", "MINDSPEED_SRC", "MINDSPEED_MM_SRC"))
