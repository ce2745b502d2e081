"""Suite-wide setup: the upstream-source tests run on the pinned sources by default.

``MEGATRON_LM_SRC`` / ``MINDSPEED_SRC`` / ``MINDSPEED_MM_SRC`` that are unset are pointed at
the checkouts unpacked from ``shared/upstream`` (see ``pinned_upstream.py``) before test
modules are collected (some read them at import).  A variable set by the caller wins.
"""

from __future__ import annotations

from pinned_upstream import export_defaults


def pytest_configure(config) -> None:
    export_defaults()


def pytest_report_header(config) -> str:
    import os

    return "upstream sources: " + ", ".join(f"{n}={os.environ.get(n, '-')}" for n in
                                              ("MEGATRON_LM_SRC", "MINDSPEED_SRC", "MINDSPEED_MM_SRC"))
