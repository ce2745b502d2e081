"""The producer's side of capacity: a first-fit allocator over its ``capacity_bytes``.

Consumers never touch it.  They release an object by deleting its index entry; the owner
reclaims the bytes of every object whose entry is gone when it next needs space.  So a put
into a full pool waits (back-pressure) and never evicts anything a consumer has not
released.
"""

from __future__ import annotations

import time
from typing import Callable, Iterable

from .errors import PoolFull


class Arena:
    """Byte ranges of one owner's segment: ``live`` key -> (offset, nbytes)."""

    def __init__(self, capacity: int, owner: str) -> None:
        if capacity <= 0:
            raise ValueError(f"pool of {owner}: capacity_bytes must be > 0, got {capacity}")
        self.capacity = capacity
        self.owner = owner
        self.live: dict[str, tuple[int, int]] = {}

    @property
    def used(self) -> int:
        return sum(n for _, n in self.live.values())

    def fit(self, nbytes: int) -> int | None:
        """First free offset with ``nbytes`` room (objects padded to 64-byte alignment)."""
        cursor = 0
        for offset, size in sorted(self.live.values()):
            if offset - cursor >= nbytes:
                return cursor
            cursor = max(cursor, offset + _aligned(size))
        return cursor if self.capacity - cursor >= nbytes else None

    def reserve(self, key: str, nbytes: int, timeout: float,
                released: Callable[[Iterable[str]], Iterable[str]]) -> int:
        """Offset for ``key``; waits up to ``timeout`` s for consumers to release space.

        ``released(keys)`` returns which of ``keys`` consumers have released."""
        if key in self.live and key not in released([key]):
            raise KeyError(f"pool put [{key}] by {self.owner}: the key is already in the pool (release it first)")
        if nbytes > self.capacity:
            raise PoolFull(f"pool put [{key}] by {self.owner}: {nbytes} bytes exceed the producer's whole "
                           f"capacity of {self.capacity} bytes (raise capacity_bytes)")
        deadline = time.monotonic() + timeout
        delay = 0.001
        while True:
            for gone in list(released(list(self.live))):
                del self.live[gone]
            offset = self.fit(nbytes)
            if offset is not None:
                self.live[key] = (offset, nbytes)
                return offset
            if time.monotonic() >= deadline:
                waiting = ", ".join(sorted(self.live)[:8]) + (" ..." if len(self.live) > 8 else "")
                raise PoolFull(
                    f"pool put [{key}] by {self.owner}: pool full for {timeout:.3g} s ({self.used} of "
                    f"{self.capacity} bytes held by {len(self.live)} unreleased object(s): {waiting}); "
                    "consumers must release() what they got, nothing unconsumed is evicted")
            time.sleep(delay)
            delay = min(delay * 2, 0.02)


def _aligned(n: int) -> int:
    return (n + 63) // 64 * 64
