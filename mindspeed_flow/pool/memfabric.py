"""``memfabric``: Ascend MemFabric Hybrid (pip ``memfabric-hybrid``), its *big memory* (BM).

Every participant contributes ``capacity_bytes`` of NPU memory (HBM) to one global virtual
address space; any participant copies bytes from host memory into any rank's contribution
and back out with one call, without the owner taking part.  So a producer's segment is its
own contribution (``peer_rank_ptr(own rank)``), ``write`` is a host-to-global copy at the
handle's offset, and a consumer's ``read`` is a global-to-host copy from the owner's
contribution.  Handles, claims and heartbeats live in the ``torch.distributed`` store
(:class:`~.index.StoreIndex`, as on the ``torch`` backend); capacity, back-pressure,
timeouts and producer death are :class:`~.base.Pool`'s.

Written against MemFabric Hybrid's documented Python API, no other call:
``doc/pythonAPI.md`` of https://github.com/Ascend/memfabric_hybrid (also on
https://gitcode.com/Ascend/memfabric_hybrid): ``memfabric_hybrid.initialize`` /
``uninitialize`` / ``get_last_err_msg``; ``bm.BmConfig`` (``auto_ranking``, ``rank_id``),
``bm.initialize(store_url, world_size, device_id, config)``, ``bm.create(id,
local_dram_size, local_hbm_size)``, ``BigMemory.join`` / ``peer_rank_ptr(peer_rank)`` /
``copy_data(src_ptr, dst_ptr, size, type)`` with ``BmCopyType.H2G`` and ``G2H`` /
``leave`` / ``destroy``, ``bm.uninitialize``; the call sequence is that of the
repository's ``example/bm/BmPython/smem_bm_example.py``.

It needs the Ascend driver (``/usr/local/Ascend/driver``) and NPUs, so it is selected only
where both the driver and the package are present and refuses with the reason elsewhere.
Nothing of it can run on a machine without an NPU: ``tests/pool/test_memfabric.py`` runs
the pool's round trip through this module against a stand-in for ``memfabric_hybrid``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

from .base import Pool
from .errors import BackendUnavailable, PoolError
from .handle import Handle
from .index import StoreIndex

ASCEND_DRIVER = Path("/usr/local/Ascend/driver")
PACKAGE = "memfabric_hybrid"
PAGE = 2 << 20  # contributions in whole 2 MB: the documented shm.create takes multiples of 2 MB only


def unavailable_reason() -> str | None:
    """``None`` when MemFabric could run here, else why not."""
    if not ASCEND_DRIVER.is_dir():
        return f"no Ascend driver ({ASCEND_DRIVER} does not exist): MemFabric runs only on Ascend NPUs"
    if importlib.util.find_spec(PACKAGE) is None:
        return f"the Ascend driver is here but {PACKAGE} is not installed (pip install memfabric-hybrid)"
    return None


def refuse(reason: str) -> BackendUnavailable:
    return BackendUnavailable(f"pool backend 'memfabric': {reason}; use --flow-pool-backend shm, torch or mooncake")


def import_memfabric() -> Any:
    """``memfabric_hybrid``, or a clear reason why it cannot be used here."""
    reason = unavailable_reason()
    if reason is not None:
        raise refuse(reason)
    try:
        return importlib.import_module(PACKAGE)
    except ImportError as exc:  # its native libraries need the CANN environment (set_env.sh)
        raise refuse(f"cannot import {PACKAGE} ({exc}); source the CANN and memfabric_hybrid set_env.sh") from None


def _from_job(option: str, value: int | None, job_value: Any, source: str) -> int:
    """An option the caller passed, else the job's value, else a clear error naming both."""
    if value is not None:
        return value
    if job_value is None:
        raise ValueError(f"pool backend 'memfabric': pass {option}= (it defaults to {source}, which is not set)")
    return int(job_value)


STORE_URL_ENV = "MINDSPEED_FLOW_MEMFABRIC_STORE_URL"


class MemFabricPool(Pool):
    """Args (besides :class:`~.base.Pool`'s): ``store_url`` (MemFabric's config store,
    ``tcp://ip:port``, the same on every rank, as in its examples; default
    ``$MINDSPEED_FLOW_MEMFABRIC_STORE_URL``, which is how a job selected by
    ``--flow-pool-backend memfabric`` gets it), ``rank`` /
    ``world_size`` (default: the ``torch.distributed`` job's), ``device_id`` (this rank's
    NPU, default ``LOCAL_RANK``),
    ``name`` (the store prefix), ``owner`` (default ``rank<rank>``), ``store`` (the
    ``torch.distributed`` store of the index, default the default group's), ``bm_id``
    (the big-memory object's id, 0-63, one per pool open at a time in a process)."""

    backend = "memfabric"

    def __init__(self, capacity_bytes: int, *, store_url: str | None = None, rank: int | None = None,
                 world_size: int | None = None, device_id: int | None = None, name: str = "pool",
                 owner: str | None = None, store: Any = None, bm_id: int = 0, **options) -> None:
        import torch.distributed as dist

        mf = import_memfabric()
        store_url = store_url or os.environ.get(STORE_URL_ENV)
        if not store_url:
            raise ValueError(f"pool backend 'memfabric': pass store_url= (MemFabric's config store, tcp://ip:port, "
                             f"the same on every rank) or export {STORE_URL_ENV}")
        job = dist.is_available() and dist.is_initialized()
        self.rank = _from_job("rank", rank, dist.get_rank() if job else None, "the torch.distributed rank")
        world_size = _from_job("world_size", world_size, dist.get_world_size() if job else None,
                               "the torch.distributed world size")
        device_id = _from_job("device_id", device_id, os.environ.get("LOCAL_RANK"), "$LOCAL_RANK")
        if store is None:
            if not job:
                raise ValueError("pool backend 'memfabric': pass store= (a torch.distributed store for the "
                                 "pool's index) or initialise torch.distributed first")
            store = dist.distributed_c10d._get_default_store()  # noqa: SLF001
        self.mf, self.bm, self.bases = mf, None, {}
        self._check(mf.initialize(), "initialize")
        try:
            self._join(store_url, world_size, device_id, bm_id, -(-capacity_bytes // PAGE) * PAGE)
        except BaseException:
            self._shut_down()
            raise
        owner = owner or f"rank{self.rank}"
        super().__init__(StoreIndex(store, f"mindspeed_flow/pool/{name}/"), owner, capacity_bytes, **options)
        self.index.set(f"bm_rank/{owner}", str(self.rank).encode())

    def _join(self, store_url: str, world_size: int, device_id: int, bm_id: int, segment: int) -> None:
        """Initialise the big memory as this rank and contribute ``segment`` bytes of HBM."""
        config = self.mf.bm.BmConfig()
        config.auto_ranking = False
        config.rank_id = self.rank
        self._check(self.mf.bm.initialize(store_url=store_url, world_size=world_size, device_id=device_id,
                                          config=config), f"bm.initialize against {store_url}")
        try:
            self.bm = self.mf.bm.create(id=bm_id, local_dram_size=0, local_hbm_size=segment)
        except RuntimeError as exc:
            raise self._refusal(f"bm.create of {segment} bytes of HBM failed ({exc})") from None
        self._check(self.bm.join(), "join")

    def _shut_down(self) -> None:
        if self.bm is not None:
            self.bm.leave()
            self.bm.destroy()
            self.bm = None
        self.mf.bm.uninitialize()
        self.mf.uninitialize()

    def _refusal(self, what: str) -> BackendUnavailable:
        return refuse(f"MemFabric {what}: {self.mf.get_last_err_msg() or 'no message'}")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise self._refusal(f"{what} failed with code {rc}")

    def base(self, owner: str, key: str, op: str) -> int:
        """The global address of ``owner``'s contribution (its rank comes from the index)."""
        if owner not in self.bases:
            raw = self.index.get(f"bm_rank/{owner}")
            if raw is None:
                raise PoolError(f"pool {op} [{key}]: producer {owner} has no MemFabric rank in the index "
                                "(it closed, or is not on this pool)")
            address = self.bm.peer_rank_ptr(peer_rank=int(raw))
            if not address:
                raise PoolError(f"pool {op} [{key}]: MemFabric has no address for producer {owner} (rank "
                                f"{int(raw)}): {self.mf.get_last_err_msg() or 'no message'}")
            self.bases[owner] = address
        return self.bases[owner]

    def _copy(self, src: int, dst: int, handle: Handle, kind: str, op: str) -> None:
        if handle.nbytes == 0:
            return
        rc = self.bm.copy_data(src_ptr=src, dst_ptr=dst, size=handle.nbytes, type=getattr(self.mf.bm.BmCopyType, kind))
        if rc != 0:
            raise PoolError(f"pool {op} [{handle.key}] by {self.owner}: MemFabric copy_data {kind} of "
                            f"{handle.nbytes} bytes (owner {handle.owner}, offset {handle.offset}) returned {rc}: "
                            f"{self.mf.get_last_err_msg() or 'no message'}")

    def write(self, handle: Handle, payload: torch.Tensor) -> None:
        """Host to this rank's HBM contribution."""
        self._copy(payload.data_ptr(), self.base(self.owner, handle.key, "put") + handle.offset, handle, "H2G", "put")

    def read(self, handle: Handle) -> torch.Tensor:
        """The owner's HBM contribution to a host tensor this process owns."""
        out = torch.empty(handle.nbytes, dtype=torch.uint8)
        self._copy(self.base(handle.owner, handle.key, "get") + handle.offset, out.data_ptr(), handle, "G2H", "get")
        return out

    def close(self) -> None:
        """Leave the big memory (this rank's contribution goes with it) and shut MemFabric down."""
        if self.closed:
            return
        super().close()
        self.index.delete(f"bm_rank/{self.owner}")
        self._shut_down()


def open_memfabric(capacity_bytes: int, **options) -> MemFabricPool:
    """The ``memfabric`` pool, or :class:`BackendUnavailable` naming why it cannot run here
    (checked before the options: off Ascend that is the answer, whatever was passed)."""
    import_memfabric()
    return MemFabricPool(capacity_bytes, **options)
