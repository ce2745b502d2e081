"""``memfabric``: Ascend MemFabric (pip ``memfabric-hybrid``).  It needs the Ascend driver
(``/usr/local/Ascend/driver``) and NPUs; it is selected only there.  Nothing of it can run
on a machine without them, so this module only decides, with a reason, whether it can."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import BackendUnavailable

ASCEND_DRIVER = Path("/usr/local/Ascend/driver")


def unavailable_reason() -> str | None:
    """``None`` when MemFabric could run here, else why not."""
    if not ASCEND_DRIVER.is_dir():
        return f"no Ascend driver ({ASCEND_DRIVER} does not exist): MemFabric runs only on Ascend NPUs"
    if importlib.util.find_spec("memfabric_hybrid") is None:
        return "the Ascend driver is here but memfabric_hybrid is not installed (pip install memfabric-hybrid)"
    return None


def open_memfabric(capacity_bytes: int, **options):
    reason = unavailable_reason()
    if reason is not None:
        raise BackendUnavailable(f"pool backend 'memfabric': {reason}; use --flow-pool-backend shm, torch or mooncake")
    raise BackendUnavailable(
        "pool backend 'memfabric': the Ascend driver and memfabric_hybrid are present, but this build of "
        "mindspeed-flow has no MemFabric data path yet (it could not be written or tested without an NPU); "
        "use --flow-pool-backend torch")
