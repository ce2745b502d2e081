"""Can each pool backend run on this machine, and if not, why (``mindspeed-flow doctor``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SHM = Path("/dev/shm")


def backend_status() -> dict[str, str | None]:
    """Backend -> ``None`` (can run here) or the reason it cannot."""
    from .memfabric import unavailable_reason
    from .mooncake import import_store, master_binary

    status: dict[str, str | None] = {"local": None}
    status["shm"] = None if SHM.is_dir() else f"{SHM} is missing (no POSIX shared memory)"
    status["torch"] = None if importlib.util.find_spec("torch.distributed") else "torch.distributed is missing"
    try:
        import_store()
        status["mooncake"] = None if master_binary() else "mooncake_master is not on PATH nor next to python"
    except Exception as exc:  # noqa: BLE001 - the reason is the report
        status["mooncake"] = str(exc)
    status["memfabric"] = unavailable_reason()
    return status
