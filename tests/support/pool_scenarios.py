"""The pool conformance scenarios: each runs on every participant of a
:class:`pool_cluster.Cluster` (rank 0 and 1 produce, the last rank consumes unless a
scenario says otherwise) and asserts inside the participant; what it returns is checked
again by the test.  The same functions run on every backend."""

from __future__ import annotations

import dataclasses
import threading
import time

import torch

from mindspeed_flow.pool import PoolFull, PoolTimeout, ProducerDied
from mindspeed_flow.pool.errors import BadHandle, StaleHandle


class Die(Exception):
    """Raised by a scenario whose participant must end right now (producer death)."""


def payloads() -> dict[str, torch.Tensor]:
    """Deterministic tensors of every kind a pool must carry byte for byte."""
    g = torch.Generator().manual_seed(11)
    base = torch.randn(6, 5, generator=g, dtype=torch.float64)
    return {
        "f32": torch.randn(4, 7, 3, generator=g),
        "bf16": torch.randn(33, generator=g).to(torch.bfloat16),
        "i64": torch.randint(-2**40, 2**40, (5, 2), generator=g),
        "bool": torch.rand(9, generator=g) > 0.5,
        "strided": base.t()[1:, ::2],  # a non-contiguous view
        "scalar": torch.tensor(3.25),
    }


def meta_of(name: str) -> dict:
    return {"sample_ids": [sum(map(ord, name)), 5], "token_counts": [17, 3], "tag": name}


def roundtrip(ctx) -> dict:
    pool = ctx.open(1 << 20)
    expected = payloads()
    handles = {}
    if ctx.rank == 0:
        for name, tensor in expected.items():
            handles[name] = pool.put(f"obj/{name}", tensor, meta_of(name))
        pool.put("embeddings/mb3", expected["f32"] * 2, {"sample_ids": [30, 31], "token_counts": [8, 9], "microbatch": 3})
    ctx.barrier.wait()
    checked = 0
    if ctx.rank != 0:
        for name, want in expected.items():
            handle = pool.handle(f"obj/{name}", timeout=10)
            got = pool.get(handle)
            assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
            assert got.contiguous().view(-1).view(torch.uint8).equal(
                want.contiguous().view(-1).view(torch.uint8)), f"{name}: bytes differ"
            assert handle.meta == meta_of(name), (name, handle.meta)
            assert handle.owner == ctx.owner(0) and handle.nbytes == want.numel() * want.element_size()
            assert handle.dtype == str(want.dtype).removeprefix("torch.") and handle.shape == tuple(want.shape)
            checked += 1
        handle = pool.handle("embeddings/mb3", timeout=10)  # whichever producer made it
        tensor = pool.get(handle)
        assert tensor.equal(expected["f32"] * 2)
        assert handle.meta == {"sample_ids": [30, 31], "token_counts": [8, 9], "microbatch": 3}
        assert handle.owner == ctx.owner(0)
    ctx.barrier.wait()
    pool.close()
    return {"checked": checked, "offsets": sorted(h.offset for h in handles.values())}


def backpressure(ctx) -> dict:
    """Capacity 4096: 'a' (3000 B) fills it; 'b' (2000 B) times out, 'a' is not evicted;
    after 'a' is released 'b' fits; 'c' blocks until a consumer releases 'b'."""
    pool = ctx.open(4096)
    out: dict = {}
    consumer = ctx.size - 1
    if ctx.rank == 0:
        pool.put("a", torch.full((750,), 1.0))
        start = time.monotonic()
        try:
            pool.put("b", torch.full((500,), 2.0), timeout=0.3)
        except PoolFull as exc:
            out["full"] = str(exc)
        out["full_after_s"] = time.monotonic() - start
    ctx.barrier.wait()
    if ctx.rank == consumer:
        assert pool.get("a", timeout=5).equal(torch.full((750,), 1.0)), "an unconsumed object changed"
        pool.release("a")
    ctx.barrier.wait()
    if ctx.rank == 0:
        pool.put("b", torch.full((500,), 2.0), timeout=5)
        start = time.monotonic()
        pool.put("c", torch.full((750,), 3.0), timeout=20)  # waits for 'b' to be released
        out["blocked_s"] = time.monotonic() - start
    if ctx.rank == consumer:
        assert pool.get("b", timeout=5).equal(torch.full((500,), 2.0))
        time.sleep(0.5)
        pool.release("b")
        assert pool.get("c", timeout=20).equal(torch.full((750,), 3.0))
        pool.release("c")
    ctx.barrier.wait()
    pool.close()
    return out


def timeouts(ctx) -> dict:
    pool = ctx.open(1 << 16)
    out: dict = {}
    if ctx.rank == 0:
        pool.announce(["late", "w1", "w2"])
    ctx.barrier.wait()
    if ctx.rank == 1:
        for key, wait in (("late", 0.5), ("nobody", 0.3)):
            start = time.monotonic()
            try:
                pool.get(key, timeout=wait)
            except PoolTimeout as exc:
                out[key] = (str(exc), time.monotonic() - start)
    ctx.barrier.wait()
    if ctx.rank == 0:
        time.sleep(0.2)
        pool.put("w1", torch.ones(3))
        pool.put("w2", torch.zeros(2))
        pool.put("late", torch.arange(4))
    if ctx.rank == 1:
        handles = pool.wait_ready(["w1", "w2"], timeout=10)
        out["ready"] = [h.key for h in handles]
        assert pool.get("late", timeout=10).equal(torch.arange(4))
    ctx.barrier.wait()
    pool.close()
    return out


def release(ctx) -> dict:
    """Capacity for exactly one object: it comes back after a release, and only then."""
    pool = ctx.open(512)
    out: dict = {}
    if ctx.rank == 0:
        pool.put("r", torch.ones(100))
    ctx.barrier.wait()
    if ctx.rank == 1:
        assert pool.get("r", timeout=5).equal(torch.ones(100))
        pool.release("r")
        out["ready_after_release"] = pool.ready("r")
        try:
            pool.release("r")
        except KeyError as exc:
            out["double_release"] = str(exc)
    ctx.barrier.wait()
    if ctx.rank == 2:
        try:
            pool.get("r", timeout=0.3)
        except PoolTimeout as exc:
            out["get_released"] = str(exc)
    ctx.barrier.wait()
    if ctx.rank == 0:
        pool.put("r", torch.full((100,), 7.0), timeout=5)  # the same key and bytes, reused
    ctx.barrier.wait()
    if ctx.rank == 1:
        assert pool.get("r", timeout=5).equal(torch.full((100,), 7.0))
        pool.release("r")
    ctx.barrier.wait()
    pool.close()
    return out


def _refusal(pool, handle, read=None) -> dict:
    """What ``pool.get(handle)`` (or ``read(handle)``) raised: its type and message."""
    try:
        got = (read or pool.get)(handle)
    except BadHandle as exc:
        return {"type": type(exc).__name__, "error": str(exc)}
    return {"type": None, "error": f"returned {got.numel()} element(s)"}


def handles(ctx) -> dict:
    """Stale, forged and mismatched handles are refused naming the key; none returns bytes.

    Rank 0 puts ``h`` (1000 bytes, the segment's first bytes); rank 1 gets it through its
    own handle and tries altered copies (another owner, offset, size, shape, dtype, version,
    key, metadata); then rank 1 releases ``h`` and ``g``, rank 0 puts ``h`` again (other
    values, the same bytes of its segment), and rank 1's old handles are stale."""
    pool = ctx.open(4096)
    out: dict = {}
    first = torch.arange(250, dtype=torch.float32)
    if ctx.rank == 0:
        out["offset_before"] = pool.put("h", first, {"n": 1}).offset
        pool.put("g", torch.ones(10))
    ctx.barrier.wait()
    if ctx.rank == 1:
        handle = pool.handle("h", timeout=10)
        replace = dataclasses.replace
        forged = {
            "owner": replace(handle, owner=ctx.owner(9)),
            "offset": replace(handle, offset=handle.offset + 64),
            "out_of_range": replace(handle, offset=1 << 40),
            "shape": replace(handle, shape=(7, 7)),
            "size": replace(handle, nbytes=16, shape=(4,)),
            "dtype": replace(handle, dtype="int32"),
            "version": replace(handle, version="forged.1"),
            "meta": replace(handle, meta={"n": 2}),
            "key": replace(handle, key="never-put"),
        }
        out["forged"] = {name: _refusal(pool, bad) for name, bad in forged.items()}
        assert pool.get(handle).equal(first), "the real handle stopped working"
        if ctx.backend == "torch":  # the owner itself serves only its live objects
            out["owner_refuses"] = _refusal(pool, forged["out_of_range"], read=pool.read)
        out["g_handle"] = pool.handle("g", timeout=10)
        pool.release("h")
        pool.release("g")
        out["old"] = handle
    ctx.barrier.wait()
    if ctx.rank == 0:
        out["offset_after"] = pool.put("h", torch.full((250,), -1.0), {"n": 1}).offset  # same key, size, bytes
    ctx.barrier.wait()
    if ctx.rank == 1:
        out["stale_reput"] = _refusal(pool, out.pop("old"))
        out["stale_released"] = _refusal(pool, out.pop("g_handle"))
        assert pool.get("h", timeout=10).equal(torch.full((250,), -1.0))
        pool.release("h")
    ctx.barrier.wait()
    pool.close()
    return out


def listeners(ctx) -> list | None:
    """Every participant opens the pool and moves an object; rank 0 then lists the listening
    sockets of the whole cluster (this process's parent and all below it)."""
    import os

    from mindspeed_flow.loopback import descendants, listening_sockets

    pool = ctx.open(1 << 16)
    if ctx.rank == 0:
        pool.put("x", torch.ones(4))
    ctx.barrier.wait()
    if ctx.rank == 1:
        assert pool.get("x", timeout=10).equal(torch.ones(4))
    ctx.barrier.wait()
    root = os.getpid() if ctx.threads else os.getppid()
    out = ([{"host": i.host, "port": i.port, "pids": list(i.pids)} for i in listening_sockets(descendants(root))]
           if ctx.rank == 0 else None)
    ctx.barrier.wait()
    pool.close()
    return out


ITEMS = 8


def concurrent(ctx) -> dict:
    """All but the last rank produce at once into room for 3 objects each; the last rank
    consumes everything as it arrives, in an order interleaving the producers."""
    pool = ctx.open(3 * 4096)
    producers = ctx.size - 1
    got = 0
    if ctx.rank < producers:
        for i in range(ITEMS):
            pool.put(f"c/{ctx.rank}/{i}", torch.full((1000,), float(ctx.rank * 100 + i)), {"i": i}, timeout=20)
    else:
        for i in range(ITEMS):
            for producer in range(producers):
                key = f"c/{producer}/{i}"
                handle = pool.handle(key, timeout=20)
                assert handle.owner == ctx.owner(producer) and handle.meta == {"i": i}
                assert pool.get(handle).equal(torch.full((1000,), float(producer * 100 + i)))
                pool.release(key)
                got += 1
    ctx.barrier.wait()
    pool.close()
    return {"got": got}


def producer_death(ctx) -> dict:
    """Rank 0 claims a key and dies; every consumer learns it, naming rank 0, well inside
    its (long) timeout."""
    pool = ctx.open(1 << 16)
    if ctx.rank == 0:
        pool.announce(["doomed"])
    ctx.barrier.wait()
    if ctx.rank != 0:  # the consumers know who will put it before it dies (Mooncake drops
        try:           # a dead client's objects, the claim among them)
            pool.get("doomed", timeout=0.01)
        except PoolTimeout as exc:
            assert f"producer {ctx.owner(0)}" in str(exc), str(exc)
    ctx.barrier.wait()
    if ctx.rank == 0:
        time.sleep(0.3)  # the consumers are waiting by now
        raise Die()
    return _get_from_dead_producer(pool, "doomed")


def _get_from_dead_producer(pool, key: str) -> dict:
    """Get ``key`` (30 s timeout) whose producer died; the error and how long it took."""
    start = time.monotonic()
    try:
        pool.get(key, timeout=30)
    except ProducerDied as exc:
        return {"error": str(exc), "after_s": time.monotonic() - start}
    finally:
        pool.close()
    raise AssertionError(f"get of [{key}] from a dead producer returned")


def producer_death_mid_read(ctx) -> dict:
    """``torch`` backend: rank 0 puts an object and dies at the moment its server starts
    sending it to rank 1 (injected: its ``isend`` reports and never sends), so rank 1 is
    inside ``get``, its receive posted, when the producer ends.  Rank 1 learns it, naming
    rank 0, well inside its (long) timeout."""
    pool = ctx.open(1 << 20)
    if ctx.rank == 0:
        serving = threading.Event()
        pool.dist = _DeadBeforeSending(pool.dist, serving)
        pool.put("mid", torch.arange(50_000, dtype=torch.float32))
    ctx.barrier.wait()
    if ctx.rank == 0:
        assert serving.wait(30), "rank 1 never asked for the object"
        raise Die()
    return _get_from_dead_producer(pool, "mid")


class _DeadBeforeSending:
    """``torch.distributed`` as the producer's pool server sees it, except that ``isend``
    sets ``serving`` and blocks for good: the process is about to die mid-transfer."""

    def __init__(self, dist, serving: threading.Event) -> None:
        self._dist, self._serving = dist, serving

    def __getattr__(self, name: str):
        return getattr(self._dist, name)

    def isend(self, *args, **kwargs):
        self._serving.set()
        threading.Event().wait()
