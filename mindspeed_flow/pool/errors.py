"""Errors of the pool: each one names the key, the producer and the pool's backend, so a
stalled consumer or a blocked producer can be traced to the rank that is at fault."""

from __future__ import annotations

from ..errors import FlowError


class PoolError(FlowError, RuntimeError):
    """Base of every pool failure."""


class PoolFull(PoolError):
    """A put waited its timeout for space: nothing unconsumed is ever evicted, so a full
    pool means consumers are not releasing (or the capacity is too small)."""


class PoolTimeout(PoolError, TimeoutError):
    """A get (or wait_ready) saw no object under a key within its timeout."""


class ProducerDied(PoolError):
    """The producer of an awaited key stopped (its process or thread ended, or it closed
    its pool) before putting it."""


class BadHandle(PoolError, ValueError):
    """A handle that does not describe the object the pool holds under its key (altered or
    forged: another owner, offset, size, dtype or shape), or that is inconsistent in itself.
    Refused before any byte is read."""


class StaleHandle(BadHandle):
    """A handle of an object that is no longer in the pool: released (maybe put again under
    the same key, maybe into the same bytes), or released while it was being read."""


class BackendUnavailable(PoolError):
    """A backend cannot run on this machine (a missing package, driver or server)."""
