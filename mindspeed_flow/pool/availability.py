"""Can each pool backend run on this machine, and if not, why (``mindspeed-flow doctor``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ..config.options import POOL_BACKENDS

SHM = Path("/dev/shm")
POOL_FEATURE = "pool"


def _shm_reason() -> str | None:
    if not SHM.is_dir():
        return f"{SHM} is missing (no POSIX shared memory)"
    return None if os.access(SHM, os.W_OK) else f"{SHM} is not writable by this user"


def _torch_reason() -> str | None:
    import torch.distributed as dist

    if not dist.is_available():
        return "this torch build has no torch.distributed"
    return None if dist.is_gloo_available() else "torch.distributed has no gloo backend (the pool's own group is gloo)"


def _mooncake_reason() -> str | None:
    from .mooncake import import_store, master_binary

    try:
        import_store()
    except Exception as exc:  # noqa: BLE001 - the reason is the report
        return str(exc)
    return None if master_binary() else "mooncake_master is not on PATH nor next to python"


def backend_status() -> dict[str, str | None]:
    """Backend -> ``None`` (can run here) or the reason it cannot, for every backend of
    :data:`~mindspeed_flow.config.POOL_BACKENDS`, in its order."""
    from .memfabric import unavailable_reason

    reasons: dict[str, Callable[[], str | None]] = {
        "local": lambda: None, "shm": _shm_reason, "torch": _torch_reason, "mooncake": _mooncake_reason,
        "memfabric": unavailable_reason}
    return {backend: reasons[backend]() for backend in POOL_BACKENDS}


def backend_rows() -> list[dict]:
    """``backend_status`` as rows of ``doctor --json`` (the keys of its patch rows):
    ``status`` is ``"available"`` or ``"unavailable"`` with the reason in ``detail``; a
    backend that cannot run here is never a failure (select another one)."""
    return [{"feature": POOL_FEATURE, "target": f"mindspeed_flow.pool:{backend}",
             "status": "available" if reason is None else "unavailable", "detail": reason or "", "version": "",
             "optional": True, "failure": False}
            for backend, reason in backend_status().items()]
