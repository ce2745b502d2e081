"""Unified memory pool: FlowTrain's globally addressable store between producers (encoder
ranks) and consumers (backbone ranks).

>>> from mindspeed_flow.pool import open_pool
>>> pool = open_pool("local", capacity_bytes=1 << 20)
>>> handle = pool.put("embeddings/mb0", torch.ones(2, 3), {"sample_ids": [7, 9]})
>>> tensor = pool.get("embeddings/mb0", timeout=10)
>>> pool.release("embeddings/mb0")

Every backend has the same API (:class:`~.base.Pool`) and passes the same conformance
suite; see ``docs/pool.md``.
"""

from __future__ import annotations

from typing import Any

from ..config.options import POOL_BACKENDS as BACKENDS
from .base import Pool
from .errors import BackendUnavailable, BadHandle, PoolError, PoolFull, PoolTimeout, ProducerDied, StaleHandle
from .handle import Handle



def open_pool(backend: str, capacity_bytes: int = 1 << 30, **options: Any) -> Pool:
    """Open this participant's view of a pool.

    Args:
        backend: ``local`` (threads), ``shm`` (processes of one node), ``torch``
            (``torch.distributed`` point-to-point; collective), ``mooncake`` (Mooncake
            Store), ``memfabric`` (Ascend MemFabric; only with the Ascend driver).
        capacity_bytes: the bytes this participant contributes for its own puts.
        options: the backend's (``name``, ``owner``, ``group``, ``master``, ...) and
            :class:`~.base.Pool`'s (``timeout_s``, ``liveness_s``, ``heartbeat_s``).
    """
    if backend == "local":
        from .local import LocalPool

        return LocalPool(capacity_bytes, **options)
    if backend == "shm":
        from .shm import ShmPool

        return ShmPool(capacity_bytes, **options)
    if backend == "torch":
        from .torch_p2p import TorchPool

        return TorchPool(capacity_bytes, **options)
    if backend == "mooncake":
        from .mooncake import MooncakePool

        return MooncakePool(capacity_bytes, **options)
    if backend == "memfabric":
        from .memfabric import open_memfabric

        return open_memfabric(capacity_bytes, **options)
    raise ValueError(f"open_pool: unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "BackendUnavailable", "BadHandle", "Handle", "Pool", "PoolError", "PoolFull", "PoolTimeout",
           "ProducerDied", "StaleHandle", "open_pool"]
