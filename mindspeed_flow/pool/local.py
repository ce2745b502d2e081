"""``local``: threads of one process share one pool by name; segments are tensors."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from .base import Pool
from .handle import Handle
from .index import MemoryIndex


@dataclass
class _Shared:
    index: MemoryIndex = field(default_factory=MemoryIndex)
    segments: dict[str, torch.Tensor] = field(default_factory=dict)
    threads: dict[str, threading.Thread] = field(default_factory=dict)


_POOLS: dict[str, _Shared] = {}
_LOCK = threading.Lock()


class LocalPool(Pool):
    """A view of the in-process pool ``name`` for the calling thread.

    A producer is alive while the thread that opened its view runs (a thread that ends
    without putting what it announced is a dead producer)."""

    backend = "local"

    def __init__(self, capacity_bytes: int, *, name: str = "default", owner: str | None = None, **options) -> None:
        with _LOCK:
            self.shared = _POOLS.setdefault(name, _Shared())
        owner = owner or f"thread{threading.get_ident()}"
        self.shared.segments[owner] = torch.empty(capacity_bytes, dtype=torch.uint8)
        self.shared.threads[owner] = threading.current_thread()
        super().__init__(self.shared.index, owner, capacity_bytes, **options)

    def write(self, handle: Handle, payload: torch.Tensor) -> None:
        self.shared.segments[self.owner][handle.offset: handle.offset + handle.nbytes].copy_(payload)

    def read(self, handle: Handle) -> torch.Tensor:
        return self.shared.segments[handle.owner][handle.offset: handle.offset + handle.nbytes].clone()

    def owner_alive(self, owner: str) -> bool:
        thread = self.shared.threads.get(owner)
        return thread is None or thread.is_alive()


def drop(name: str) -> None:
    """Forget the in-process pool ``name`` (its views must be closed)."""
    with _LOCK:
        _POOLS.pop(name, None)
