"""Participants of one pool for the conformance suite: threads (``local``) or spawned
processes (``shm``, ``torch``, ``mooncake``) that run named scenarios of
:mod:`pool_scenarios` on command, so one set of workers serves a whole backend's suite.

Processes of the ``torch`` backend join one gloo group whose store lives in this process
(a dying participant takes no store with it).  :meth:`Cluster.stop` ends every worker:
politely, then by ``kill`` after a timeout.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from mindspeed_flow.loopback import tcp_store_server

LOOPBACK = "127.0.0.1"


@dataclass
class Context:
    """What a scenario sees: its rank, the world, and how to open this backend's pool."""

    backend: str
    rank: int
    size: int
    options: dict
    barrier: Any
    threads: bool
    scenario: str = ""
    extra: dict = field(default_factory=dict)

    def owner(self, rank: int) -> str:
        return f"rank{rank}" if self.backend == "torch" else f"p{rank}"

    def open(self, capacity_bytes: int, **options: Any):
        from mindspeed_flow.pool import open_pool

        merged = {**self.options, "name": f"{self.options.get('name', 'conf')}-{self.scenario}",
                  "liveness_s": 2.0, "timeout_s": 20.0, **options}
        if self.backend != "torch":
            merged["owner"] = self.owner(self.rank)
        return open_pool(self.backend, capacity_bytes=capacity_bytes, **merged)


def _serve(ctx: Context, inbox: Any, outbox: Any) -> None:
    import pool_scenarios

    while True:
        message = inbox.get()
        if message is None:
            return
        ctx.scenario = message
        try:
            outbox.put((ctx.rank, "ok", getattr(pool_scenarios, message)(ctx)))
        except pool_scenarios.Die:
            outbox.put((ctx.rank, "ok", "died"))
            if ctx.threads:
                return  # the thread that opened the producer's view ends: a dead producer
            outbox.close()
            outbox.join_thread()
            os._exit(3)
        except BaseException:  # noqa: BLE001 - reported to the test, which fails with it
            outbox.put((ctx.rank, "error", traceback.format_exc()))


def _process_main(ctx: Context, store_port: int | None, inbox: Any, outbox: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets on loopback
    if ctx.backend == "torch":
        import torch.distributed as dist

        store = dist.TCPStore(LOOPBACK, store_port, ctx.size, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=ctx.rank, world_size=ctx.size,
                                timeout=timedelta(seconds=60))
    _serve(ctx, inbox, outbox)


class Cluster:
    """``size`` participants of ``backend`` (threads for ``local``, else processes)."""

    def __init__(self, backend: str, size: int, options: dict | None = None) -> None:
        self.backend, self.size = backend, size
        self.threads = backend == "local"
        options = dict(options or {})
        if self.threads:
            self.outbox: Any = queue.Queue()
            self.inboxes: list[Any] = [queue.Queue() for _ in range(size)]
            barrier: Any = threading.Barrier(size, timeout=60)
        else:
            mp = multiprocessing.get_context("spawn")
            self.outbox = mp.Queue()
            self.inboxes = [mp.Queue() for _ in range(size)]
            barrier = mp.Barrier(size, timeout=60)
        self.barrier = barrier  # spawned children rebuild it from its name: keep it alive here
        self.store = None
        if backend == "torch":
            self.store = tcp_store_server(size, host=LOOPBACK, timeout=timedelta(seconds=60))  # 127.0.0.1 only
        self.workers: list[Any] = []
        for rank in range(size):
            ctx = Context(backend, rank, size, options, barrier, self.threads)
            if self.threads:
                worker: Any = threading.Thread(target=_serve, args=(ctx, self.inboxes[rank], self.outbox),
                                               name=f"pool-{backend}-{rank}", daemon=True)
            else:
                worker = mp.Process(target=_process_main, args=(ctx, self.store.port if self.store else None,
                                                                self.inboxes[rank], self.outbox),
                                    name=f"pool-{backend}-{rank}", daemon=True)
            worker.start()
            self.workers.append(worker)

    def run(self, scenario: str, timeout_s: float = 90.0) -> list[Any]:
        """Every participant runs ``scenario``; their results by rank.  A participant that
        reports ``"died"`` is expected to end (producer death)."""
        for inbox in self.inboxes:
            inbox.put(scenario)
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < self.size:
            try:
                rank, status, value = self.outbox.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                missing = sorted(set(range(self.size)) - set(results))
                raise TimeoutError(f"{self.backend}/{scenario}: ranks {missing} did not answer in {timeout_s} s")
            if status == "error":
                raise AssertionError(f"{self.backend}/{scenario} rank {rank} failed:\n{value}")
            results[rank] = value
        return [results[r] for r in range(self.size)]

    def stop(self) -> None:
        for inbox, worker in zip(self.inboxes, self.workers):
            if worker.is_alive():
                inbox.put(None)
        for worker in self.workers:
            worker.join(timeout=10)
            if not self.threads and worker.is_alive():
                worker.kill()
                worker.join(timeout=5)
