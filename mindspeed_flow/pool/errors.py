"""Errors of the pool: each one names the key, the producer and the pool's backend, so a
stalled consumer or a blocked producer can be traced to the rank that is at fault."""

from __future__ import annotations


class PoolError(RuntimeError):
    """Base of every pool failure."""


class PoolFull(PoolError):
    """A put waited its timeout for space: nothing unconsumed is ever evicted, so a full
    pool means consumers are not releasing (or the capacity is too small)."""


class PoolTimeout(PoolError, TimeoutError):
    """A get (or wait_ready) saw no object under a key within its timeout."""


class ProducerDied(PoolError):
    """The producer of an awaited key stopped (its process or thread ended, or it closed
    its pool) before putting it."""


class BackendUnavailable(PoolError):
    """A backend cannot run on this machine (a missing package, driver or server)."""
