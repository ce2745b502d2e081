"""``torch``: point-to-point over ``torch.distributed``: any cluster Megatron runs on.

The index is the job's store (``TCPStore``).  A producer's segment is a ``uint8`` tensor
in its own memory; a consumer that wants an object posts a request under the owner's
request counter in the store, and the owner's server thread sends the bytes with a
``send`` on the pool's own process group (so pool traffic never meets the job's tags),
which the consumer ``recv``s.  Opening is collective over the group (it creates the pool's
group).  The owner serves only what it holds: a request whose key, version, offset and size
are not a live object of its segment is refused (``rej/<owner>/<seq>`` in the store, which
the waiting consumer raises as :class:`~.errors.BadHandle`), never answered with whatever
the segment holds there.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from .base import Pool
from .errors import BadHandle, ProducerDied
from .handle import Handle
from .index import StoreIndex


class TorchPool(Pool):
    """Args (besides :class:`~.base.Pool`'s): ``name`` (the store prefix), ``group``
    (default: a new gloo group of the whole world), ``store`` (default: the default
    group's store)."""

    backend = "torch"

    def __init__(self, capacity_bytes: int, *, name: str = "pool", group: Any = None, store: Any = None,
                 **options) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("pool backend 'torch' needs torch.distributed initialised "
                               "(init_process_group) before open_pool")
        self.dist = dist
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self.rank = dist.get_rank()
        store = store if store is not None else dist.distributed_c10d._get_default_store()  # noqa: SLF001
        self.segment = torch.empty(capacity_bytes, dtype=torch.uint8)
        self.fetch_lock = threading.Lock()
        self._versions: dict[str, str] = {}  # key -> version of what this owner's segment holds
        super().__init__(StoreIndex(store, f"mindspeed_flow/pool/{name}/"), f"rank{self.rank}", capacity_bytes,
                         **options)
        self.served = 0
        self.server = threading.Thread(target=self._serve, name=f"pool-rank{self.rank}-server", daemon=True)
        self.server.start()

    def write(self, handle: Handle, payload: torch.Tensor) -> None:
        self._versions[handle.key] = handle.version
        self.segment[handle.offset: handle.offset + handle.nbytes].copy_(payload)

    def read(self, handle: Handle) -> torch.Tensor:
        if handle.owner == self.owner:
            return self.segment[handle.offset: handle.offset + handle.nbytes].clone()
        owner_rank = _rank_of(handle)
        out = torch.empty(handle.nbytes, dtype=torch.uint8)
        with self.fetch_lock:
            seq = self.index.store.add(f"reqs/{handle.owner}", 1)
            work = self.dist.irecv(out, src=owner_rank, group=self.group, tag=seq)
            self.index.set(f"req/{handle.owner}/{seq}", json.dumps(
                [self.rank, handle.offset, handle.nbytes, handle.key, handle.version]).encode())
            self._await(work, handle, seq)
        return out

    def _await(self, work: Any, handle: Handle, seq: int) -> None:
        """Wait for the bytes while watching the owner: gloo's receive completes only inside
        ``wait``, so a helper thread waits and this one checks the owner's heartbeat."""
        failure: list[BaseException] = []

        def wait() -> None:
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                failure.append(exc)

        waiter = threading.Thread(target=wait, name=f"pool-{self.owner}-recv", daemon=True)
        waiter.start()
        deadline = time.monotonic() + self.timeout_s
        delay = 0.0001
        while waiter.is_alive():
            waiter.join(delay)
            delay = min(delay * 2, 0.01)
            refused = self.index.get(f"rej/{handle.owner}/{seq}") if waiter.is_alive() else None
            if refused is not None:
                self.index.delete(f"rej/{handle.owner}/{seq}")  # the posted receive (its own tag) never completes
                raise BadHandle(f"pool get [{handle.key}]: producer {handle.owner} refused the request: "
                                f"{refused.decode()} (torch backend)")
            if waiter.is_alive() and not self.owner_alive(handle.owner):
                raise ProducerDied(f"pool get [{handle.key}]: producer {handle.owner} died while serving it "
                                   f"(no heartbeat for {self.liveness_s:.3g} s, torch backend)")
            if waiter.is_alive() and time.monotonic() > deadline:
                raise ProducerDied(f"pool get [{handle.key}]: producer {handle.owner} did not send it within "
                                   f"{self.timeout_s:.3g} s (torch backend)")
        if failure:
            raise ProducerDied(f"pool get [{handle.key}]: receiving from producer {handle.owner} failed: "
                               f"{failure[0]}")

    def _serve(self) -> None:
        """Answer requests in order; a request is ``[rank, offset, nbytes, key, version]``, served
        only when it names a live object of this segment exactly."""
        delay = 0.0002
        while not self._stop.is_set():
            raw = self.index.get(f"req/{self.owner}/{self.served + 1}")
            if raw is None:
                time.sleep(delay)
                delay = min(delay * 2, 0.005)
                continue
            delay = 0.0002
            self.served += 1
            self.index.delete(f"req/{self.owner}/{self.served}")
            rank, offset, nbytes, key, version = json.loads(raw)
            refusal = self._refusal(key, version, offset, nbytes)
            if refusal is not None:
                self.index.set(f"rej/{self.owner}/{self.served}", refusal.encode())
                continue
            try:
                work = self.dist.isend(self.segment[offset: offset + nbytes], dst=rank, group=self.group,
                                       tag=self.served)
                work.wait(timedelta(seconds=self.timeout_s))
            except Exception:  # noqa: BLE001 - that consumer went away; serve the others
                continue

    def _released(self, keys):
        gone = super()._released(keys)
        for key in gone:
            self._versions.pop(key, None)
        return gone

    def _refusal(self, key: str, version: str, offset: int, nbytes: int) -> str | None:
        """Why a request is not served, or None: it must be a live object of this segment."""
        live = self.arena.live.get(key)
        if live is None or self._versions.get(key) != version:
            return f"[{key}] version {version} is not an object of its segment (released or never put)"
        if live != (offset, nbytes) or offset < 0 or offset + nbytes > self.segment.numel():
            return f"[{key}] lies at offset {live[0]} ({live[1]} bytes), not at offset {offset} ({nbytes} bytes)"
        return None

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self.server.join(timeout=self.timeout_s)


def _rank_of(handle: Handle) -> int:
    owner = handle.owner
    if not (owner.startswith("rank") and owner[4:].isdigit()):
        raise BadHandle(f"pool get [{handle.key}]: owner {owner!r} is not a participant of this torch pool "
                        "(owners are rank<N>)")
    return int(owner[4:])
