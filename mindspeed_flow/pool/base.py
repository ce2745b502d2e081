"""The pool's API, the same on every backend.

A backend supplies three things: an :class:`~.index.Index` every process can read, the
producer's segment (``write`` the payload at an offset), and ``read`` of a handle's bytes
from any process.  Everything else is here, once: capacity and back-pressure
(:class:`~.arena.Arena`), claims (which producer will put a key), heartbeats (is that
producer still alive) and timeouts.

Index layout (keys of the index, not of the pool):
``obj/<key>`` the handle (JSON); ``claim/<key>`` the producer that announced the key;
``alive/<owner>`` a heartbeat counter; ``closed/<owner>`` set when a producer closes.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from typing import Any, Iterable, Sequence

import torch

from .arena import Arena
from .errors import BadHandle, PoolError, PoolTimeout, ProducerDied, StaleHandle
from .handle import Handle, check_layout, check_meta, dtype_name, from_bytes, to_bytes
from .index import Index

DEFAULT_TIMEOUT_S = 60.0


class Pool:
    """One process's (or thread's) view of a pool; see :func:`~mindspeed_flow.pool.open_pool`.

    Args:
        index: the shared index.
        owner: this participant's name in handles, claims and errors (``"rank3"``).
        capacity_bytes: the bytes this participant contributes for its own puts; a put
            that does not fit waits for consumers to ``release``.
        timeout_s: default timeout of put, get and wait_ready.
        liveness_s: a producer whose heartbeat has not moved for this long is dead.
        heartbeat_s: how often this participant's heartbeat moves.
    """

    backend = "?"

    def __init__(self, index: Index, owner: str, capacity_bytes: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 liveness_s: float = 3.0, heartbeat_s: float = 0.2) -> None:
        self.index = index
        self.owner = owner
        self.arena = Arena(capacity_bytes, owner)
        self.timeout_s = timeout_s
        self.liveness_s = liveness_s
        self.heartbeat_s = heartbeat_s
        self.closed = False
        self._seen: dict[str, tuple[bytes | None, float]] = {}
        self._claims: dict[str, str] = {}  # claims seen: they may vanish with their producer
        self._instance = secrets.token_hex(6)  # a handle's version: this view's id and its put count
        self._puts = itertools.count(1)
        self._stop = threading.Event()
        self._beats = 0
        self._beat()
        self._heart = threading.Thread(target=self._heartbeat, name=f"pool-{owner}-heartbeat", daemon=True)
        self._heart.start()

    # ------------------------------------------------------------------ backend hooks

    def write(self, handle: Handle, payload: torch.Tensor) -> None:
        """Copy ``payload`` (flat uint8) into this owner's segment at ``handle.offset``."""
        raise NotImplementedError

    def read(self, handle: Handle) -> torch.Tensor:
        """The flat uint8 payload of ``handle``, a copy this process owns."""
        raise NotImplementedError

    def owner_alive(self, owner: str) -> bool:
        """Whether ``owner`` still runs: by default, whether its heartbeat moved lately."""
        beat = self.index.get(f"alive/{owner}")
        now = time.monotonic()
        last, since = self._seen.get(owner, (None, now))
        if beat != last or owner not in self._seen:
            self._seen[owner] = (beat, now)
            return True
        return now - since < self.liveness_s

    # ------------------------------------------------------------------ producer side

    def announce(self, keys: Iterable[str]) -> None:
        """Claim ``keys``: this participant will put them.  A consumer waiting for one of
        them learns who to blame if it never comes, and notices if this producer dies."""
        for key in keys:
            self.index.set(f"claim/{key}", self.owner.encode())

    def put(self, key: str, tensor: torch.Tensor, meta: dict | None = None, *,
            timeout: float | None = None) -> Handle:
        """Put ``tensor`` under ``key`` with ``meta``; blocks while the pool is full.

        Raises :class:`PoolFull` after ``timeout`` s without space (nothing unreleased is
        evicted), ``KeyError`` if ``key`` is already in the pool."""
        self._check_open("put", key)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"pool put [{key}]: expected a torch.Tensor, got {type(tensor).__name__}")
        meta = check_meta(key, meta)
        if self.index.has(f"obj/{key}"):
            raise KeyError(f"pool put [{key}] by {self.owner}: the key is already in the pool (release it first)")
        payload = to_bytes(tensor)
        offset = self.arena.reserve(key, payload.numel(), self._timeout(timeout), self._released)
        handle = Handle(key, self.owner, offset, payload.numel(), dtype_name(tensor.dtype), tuple(tensor.shape),
                        meta, version=f"{self._instance}.{next(self._puts)}")
        self.write(handle, payload)
        self.index.set(f"obj/{key}", handle.to_json())
        return handle

    def _released(self, keys: Iterable[str]) -> list[str]:
        return [k for k in keys if not self.index.has(f"obj/{k}")]

    # ------------------------------------------------------------------ consumer side

    def handle(self, key: str, timeout: float | None = None, producer: str | None = None) -> Handle:
        """The handle of ``key`` once it is in the pool (see :meth:`get` for the errors)."""
        timeout = self._timeout(timeout)
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while True:
            raw = self.index.get(f"obj/{key}")
            if raw is not None:
                return Handle.from_json(raw)
            expected = producer or self._claimant(key)
            if expected is not None:
                if self.index.has(f"closed/{expected}"):
                    raise ProducerDied(f"pool get [{key}]: producer {expected} closed its pool without putting it "
                                       f"({self.backend} backend)")
                if not self.owner_alive(expected):
                    raise ProducerDied(f"pool get [{key}]: producer {expected} died before putting it (no heartbeat "
                                       f"for {self.liveness_s:.3g} s, {self.backend} backend)")
            if time.monotonic() >= deadline:
                who = (f"producer {expected}" if expected is not None
                       else "no producer has announced it")
                raise PoolTimeout(f"pool get [{key}]: not in the pool after {timeout:.3g} s ({who}; "
                                  f"{self.backend} backend)")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def get(self, key_or_handle: str | Handle, timeout: float | None = None, *,
            producer: str | None = None) -> torch.Tensor:
        """The tensor under a key (waiting up to ``timeout`` s for it) or of a handle.

        Raises :class:`PoolTimeout` naming the key and its producer, or
        :class:`ProducerDied` as soon as that producer is known to be gone.  A handle is
        checked against the object the pool holds under its key, before and after the
        bytes are read: :class:`StaleHandle` when that object was released (or released
        and put again) - also while it was being read, so a get never returns bytes
        another put has overwritten - and :class:`BadHandle` when any field (owner,
        offset, size, dtype, shape, metadata) differs from the pool's."""
        if isinstance(key_or_handle, Handle):
            self._check_open("get", key_or_handle.key)
            handle = self.verify(key_or_handle)
        else:
            handle = self.handle(key_or_handle, timeout, producer)
        return self._read_checked(handle)

    def _read_checked(self, handle: Handle) -> torch.Tensor:
        self._check_open("get", handle.key)
        payload = self.read(handle)
        self.verify(handle, reading=True)  # the owner reuses bytes only after the entry is gone
        return from_bytes(payload, handle)

    def verify(self, handle: Handle, *, reading: bool = False) -> Handle:
        """The pool's handle for ``handle.key`` when ``handle`` is exactly it; else
        :class:`StaleHandle` / :class:`BadHandle` naming the key."""
        if not isinstance(handle, Handle):
            raise TypeError(f"pool get: expected a key or a Handle, got {type(handle).__name__}")
        key = handle.key
        raw = self.index.get(f"obj/{key}")
        when = " while it was being read" if reading else ""
        if raw is None:
            raise StaleHandle(f"pool get [{key}]: stale handle (version {handle.version or '?'} of {handle.owner}): "
                              f"the object was released{when}, or never put; refused ({self.backend} backend)")
        current = Handle.from_json(raw)
        if current.version != handle.version:
            raise StaleHandle(f"pool get [{key}]: stale handle (version {handle.version or '?'} of {handle.owner}): "
                              f"the key was released and put again{when} (the pool's object is version "
                              f"{current.version} of {current.owner}; or the handle is forged); refused "
                              f"({self.backend} backend)")
        differences = current.differences(handle)
        if differences:
            raise BadHandle(f"pool get [{key}]: the handle does not match the pool's object: "
                            f"{'; '.join(differences)}; refused ({self.backend} backend)")
        try:
            check_layout(current)
        except ValueError as exc:
            raise BadHandle(f"{exc}; refused ({self.backend} backend)") from None
        return current

    def wait_ready(self, keys: Sequence[str], timeout: float | None = None) -> list[Handle]:
        """Block until every key is in the pool (one shared deadline); their handles."""
        deadline = time.monotonic() + self._timeout(timeout)
        return [self.handle(k, max(0.0, deadline - time.monotonic())) for k in keys]

    def ready(self, key: str) -> bool:
        """Whether ``key`` is in the pool now (never blocks)."""
        return self.index.has(f"obj/{key}")

    def release(self, key: str) -> None:
        """Drop ``key`` from the pool; its owner reuses the space for its next put.

        Raises ``KeyError`` if the key is not in the pool."""
        if not self.index.has(f"obj/{key}"):
            raise KeyError(f"pool release [{key}]: not in the pool (never put, or released already)")
        self.index.delete(f"obj/{key}")
        self.index.delete(f"claim/{key}")

    # ------------------------------------------------------------------ life cycle

    def close(self) -> None:
        """Stop the heartbeat and tell waiting consumers this producer will put nothing more.
        The owner's memory goes with it: consumers must have read what they need."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._heart.join(timeout=5)
        self.index.set(f"closed/{self.owner}", b"1")

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the index went away (shutdown): consumers will notice
                return

    def _beat(self) -> None:
        self._beats += 1
        self.index.set(f"alive/{self.owner}", str(self._beats).encode())

    def _claimant(self, key: str) -> str | None:
        raw = self.index.get(f"claim/{key}")
        if raw is not None:
            self._claims[key] = raw.decode()
        return self._claims.get(key)

    def _timeout(self, timeout: float | None) -> float:
        return self.timeout_s if timeout is None else timeout

    def _check_open(self, op: str, key: str) -> None:
        if self.closed:
            raise PoolError(f"pool {op} [{key}]: the pool of {self.owner} is closed")
