"""The pool as the ranks of one tensor-parallel group see it.

Every TP rank of an encoder replica or of the first backbone stage runs the same plan, with
its ``PUT``s and ``GET``s, but the pool holds each object once: only the group's *leader*
(its TP rank 0) reads and writes the pool.  A ``get`` on the leader is broadcast to the
group (shape and dtype first, so the others need not know them); a ``put`` by another rank
is dropped, because a TP group's output (embeddings, or the gradient of the replicated
input of a TP backbone) is the same tensor on every TP rank; ``release`` is the leader's.
If the leader's get fails (timeout, dead producer), every rank of the group raises it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .errors import PoolError


class TensorParallelPool:
    """Args:
        pool: the leader's :class:`~.base.Pool`; ``None`` on the other ranks.
        group: the TP group.
        leader: the leader's global rank.
    """

    def __init__(self, pool: Any, group: Any, leader: int) -> None:
        self.is_leader = dist.get_rank() == leader
        if self.is_leader == (pool is None):
            raise ValueError(f"TensorParallelPool: the leader (rank {leader}) and only it opens the pool; rank "
                             f"{dist.get_rank()} got {'no pool' if pool is None else 'a pool'}")
        self.pool, self.group, self.leader = pool, group, leader

    def put(self, key: str, tensor: torch.Tensor, meta: dict | None = None, *, timeout: float | None = None) -> Any:
        """The leader's put; ``None`` elsewhere (the leader holds the same tensor)."""
        return self.pool.put(key, tensor, meta, timeout=timeout) if self.is_leader else None

    def get(self, key: str, timeout: float | None = None) -> torch.Tensor:
        """The leader gets ``key`` and broadcasts it; every rank returns it (or raises the
        leader's error)."""
        header: list[Any] = [None, None]
        tensor = None
        if self.is_leader:
            try:
                tensor = self.pool.get(key, timeout).contiguous()
                header = [tuple(tensor.shape), tensor.dtype]
            except PoolError as exc:
                header = [None, f"{type(exc).__name__}: {exc}"]
                dist.broadcast_object_list(header, src=self.leader, group=self.group)
                raise
        dist.broadcast_object_list(header, src=self.leader, group=self.group)
        shape, dtype = header
        if shape is None:
            raise PoolError(f"pool get [{key}] by TP leader rank {self.leader} failed: {dtype}")
        if tensor is None:
            tensor = torch.empty(shape, dtype=dtype)
        dist.broadcast(tensor, src=self.leader, group=self.group)
        return tensor

    def release(self, key: str) -> None:
        if self.is_leader:
            self.pool.release(key)

    def close(self) -> None:
        if self.is_leader:
            self.pool.close()
