"""The flow's per-sample transfers through the pool, shared by its producer and consumer.

Both sides wait on *sets* of keys and take whichever entry is ready first, instead of one key
after the other: a consumer taking a microbatch's samples, or a producer collecting a step's
embedding gradients, then never holds a ready entry hostage to one that comes later, which is
what lets both work with a pool smaller than a step (back-pressure, never eviction).  A put
that does not fit waits in short slices and lets its caller do useful work in between (a
trainable producer collects gradients there, freeing the consumers' segments).
"""

from __future__ import annotations

import time
from typing import Callable, Iterable, Mapping

import torch

from ..pool import Handle, Pool, PoolFull, PoolTimeout

MAX_POLL_S = 0.005


def take_ready(pool: Pool, keys: Iterable[str]) -> dict[str, tuple[Handle, torch.Tensor]]:
    """Every one of ``keys`` that is in the pool now: its handle and tensor, released from
    the pool (the taker owns the copy).  Never blocks."""
    taken = {}
    for key in keys:
        if pool.ready(key):
            handle = pool.handle(key, timeout=0)
            taken[key] = (handle, pool.get(handle))
            pool.release(key)
    return taken


class Waiting:
    """One wait for a set of keys, with its deadline: :meth:`idle` sleeps a little longer
    each time nothing arrived, raises :class:`~mindspeed_flow.pool.ProducerDied` as soon as the
    producer of ``key`` is known gone and :class:`~mindspeed_flow.pool.PoolTimeout` naming it
    once the deadline passed."""

    def __init__(self, pool: Pool, timeout_s: float, what: str) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.what = what
        self.deadline = time.monotonic() + timeout_s
        self.delay = 0.0002

    def progressed(self) -> None:
        """Something arrived: poll quickly again."""
        self.delay = 0.0002

    def idle(self, key: str) -> None:
        """Nothing of the set arrived; ``key`` is one still missing."""
        try:
            self.pool.handle(key, timeout=0)  # raises ProducerDied at once when its producer is gone
        except PoolTimeout as exc:
            if self.expired():
                raise PoolTimeout(f"{self.what}: still waiting after {self.timeout_s:.3g} s; {exc}") from None
        self.pause()

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def pause(self) -> None:
        """Sleep a little longer each time (up to ``MAX_POLL_S``)."""
        time.sleep(self.delay)
        self.delay = min(self.delay * 2, MAX_POLL_S)


def take_all(pool: Pool, keys: Iterable[str], timeout_s: float, what: str) -> dict[str, tuple[Handle, torch.Tensor]]:
    """Every one of ``keys``, each taken as soon as it is ready (:func:`take_ready`)."""
    missing = list(dict.fromkeys(keys))
    taken: dict[str, tuple[Handle, torch.Tensor]] = {}
    waiting = Waiting(pool, timeout_s, what)
    while missing:
        now = take_ready(pool, missing)
        if now:
            taken.update(now)
            missing = [k for k in missing if k not in now]
            waiting.progressed()
        else:
            waiting.idle(missing[0])
    return taken


def put_waiting(pool: Pool, key: str, tensor: torch.Tensor, meta: Mapping, *, timeout_s: float,
                while_full: Callable[[], None] = lambda: None, slice_s: float = 0.02) -> int:
    """Put ``tensor`` under ``key``; while the owner's segment is full, wait in slices of
    ``slice_s`` and call ``while_full()`` between them.  Returns how many slices it waited;
    :class:`~mindspeed_flow.pool.PoolFull` after ``timeout_s`` (nothing is evicted) or at once
    when the tensor is larger than the owner's whole capacity."""
    tensor = tensor.detach().contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    capacity = pool.arena.capacity
    if nbytes > capacity:
        raise PoolFull(f"pool put [{key}] by {pool.owner}: {nbytes} bytes exceed the producer's whole capacity of "
                       f"{capacity} bytes (raise capacity_bytes)")
    deadline = time.monotonic() + timeout_s
    waits = 0
    while True:
        try:
            pool.put(key, tensor, dict(meta), timeout=slice_s)
            return waits
        except PoolFull as exc:
            if time.monotonic() >= deadline:
                raise PoolFull(f"{exc} [waited {timeout_s:.3g} s in all]") from None
            waits += 1
            while_full()
