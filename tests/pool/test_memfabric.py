"""The ``memfabric`` pool's data path (``mindspeed_flow/pool/memfabric.py``), run here
through a STAND-IN for ``memfabric_hybrid``.

MemFabric needs Ascend NPUs and their driver, which cannot exist on this machine, so
``StandInMemFabric`` below stands in for the package: it implements only the documented
calls the pool uses (``doc/pythonAPI.md`` of Ascend/memfabric_hybrid) and refuses what the
documentation says the library needs (``initialize`` before ``bm.initialize``, a
``rank_id`` inside the world, ``create`` after ``bm.initialize``, ``join`` before copies, a
copy's global side inside one rank's contribution, the copy type naming the direction).
Each rank's HBM contribution is a host tensor of the stand-in's "global space", and
``copy_data`` really moves the bytes between the addresses it is given.  MemFabric's
initialisation is per process; here each thread stands for one process, so the stand-in's
state is per thread.  The pool's index is a real ``torch.distributed`` ``TCPStore`` on
127.0.0.1, and the conformance scenarios of :mod:`pool_scenarios` run through it.
"""

from __future__ import annotations

import ctypes
import enum
import threading
import types
from datetime import timedelta

import pytest
import torch

import pool_scenarios
from mindspeed_flow.pool import BackendUnavailable, PoolError, open_pool
from mindspeed_flow.loopback import tcp_store_server
from mindspeed_flow.pool import memfabric
from pool_cluster import LOOPBACK, Context

SIZE = 3
STORE_URL = "tcp://127.0.0.1:18570"  # the stand-in opens nothing: MemFabric's config store is not run here


class StandInMemFabric:
    """Stand-in for ``memfabric_hybrid`` (cannot exist without an NPU): ``module`` is what
    ``import memfabric_hybrid`` gives; ``hbm[store_url][rank]`` is each rank's contribution."""

    class BmCopyType(enum.Enum):
        L2G = 0
        G2L = 1
        G2H = 2
        H2G = 3

    class BmConfig:
        def __init__(self) -> None:
            self.auto_ranking = False
            self.rank_id = 0

    def __init__(self) -> None:
        self.hbm: dict[str, dict[int, torch.Tensor]] = {}
        self.process = threading.local()  # MemFabric's per-process state; a thread is a process here
        self.calls: list[tuple[int, str]] = []
        bm = types.SimpleNamespace(BmConfig=self.BmConfig, BmCopyType=self.BmCopyType, initialize=self.bm_initialize,
                                   uninitialize=self.bm_uninitialize, create=self.bm_create)
        self.module = types.SimpleNamespace(initialize=self.initialize, uninitialize=self.uninitialize,
                                            get_last_err_msg=self.get_last_err_msg, bm=bm)

    def _state(self) -> types.SimpleNamespace:
        if not hasattr(self.process, "state"):
            self.process.state = types.SimpleNamespace(up=False, rank=None, url=None, error="")
        return self.process.state

    def _fail(self, message: str) -> int:
        self._state().error = message
        return -1

    def initialize(self, flags: int = 0) -> int:
        self._state().up = True
        return 0

    def uninitialize(self) -> None:
        self._state().up = False
        self.calls.append((self._state().rank, "uninitialize"))

    def get_last_err_msg(self) -> str:
        return self._state().error

    def bm_initialize(self, store_url: str, world_size: int, device_id: int, config: BmConfig) -> int:
        state = self._state()
        if not state.up:
            return self._fail("smem not initialized")
        if config.auto_ranking or not 0 <= config.rank_id < world_size:
            return self._fail(f"rank_id {config.rank_id} not in world of {world_size}")
        state.rank, state.url = config.rank_id, store_url
        self.hbm.setdefault(store_url, {})
        return 0

    def bm_uninitialize(self, flags: int = 0) -> None:
        self._state().url = None

    def bm_create(self, id: int, local_dram_size: int, local_hbm_size: int, data_op_type=None,
                  flags: int = 0) -> "StandInBigMemory":
        state = self._state()
        if state.url is None or not 0 <= id <= 63:
            raise RuntimeError("create bm handle failed.")
        return StandInBigMemory(self, self.hbm[state.url], state.rank, local_hbm_size)


class StandInBigMemory:
    """Stand-in for ``memfabric_hybrid.bm.BigMemory`` (see :class:`StandInMemFabric`)."""

    def __init__(self, fabric: StandInMemFabric, space: dict[int, torch.Tensor], rank: int, size: int) -> None:
        self.fabric, self.space, self.rank, self.size, self.joined = fabric, space, rank, size, False

    def join(self, flags: int = 0) -> int:
        self.space[self.rank] = torch.zeros(self.size, dtype=torch.uint8)
        self.joined = True
        return 0

    def leave(self, flags: int = 0) -> int:
        self.space.pop(self.rank, None)
        self.joined = False
        return 0

    def destroy(self) -> None:
        self.fabric.calls.append((self.rank, "destroy"))

    def peer_rank_ptr(self, peer_rank: int) -> int:
        contribution = self.space.get(peer_rank)
        return 0 if contribution is None else contribution.data_ptr()

    def _in_global(self, address: int, size: int) -> bool:
        return any(t.data_ptr() <= address and address + size <= t.data_ptr() + t.numel() for t in self.space.values())

    def copy_data(self, src_ptr: int, dst_ptr: int, size: int, type: enum.Enum, flags: int = 0) -> int:
        if not self.joined:
            return self.fabric._fail("not joined")
        if type not in (StandInMemFabric.BmCopyType.H2G, StandInMemFabric.BmCopyType.G2H):
            return self.fabric._fail(f"copy type {type} is not host<->global")
        global_side = dst_ptr if type is StandInMemFabric.BmCopyType.H2G else src_ptr
        if not self._in_global(global_side, size):
            return self.fabric._fail(f"{size} bytes at {global_side:#x} are outside every rank's contribution")
        ctypes.memmove(dst_ptr, src_ptr, size)
        return 0


@pytest.fixture
def fabric(tmp_path, monkeypatch):
    """The stand-in as ``memfabric_hybrid``, a stand-in Ascend driver directory, and a
    real TCPStore for the pool's index."""
    stand_in = StandInMemFabric()
    monkeypatch.setattr(memfabric, "ASCEND_DRIVER", tmp_path)  # stand-in for /usr/local/Ascend/driver
    find_spec, import_module = memfabric.importlib.util.find_spec, memfabric.importlib.import_module
    monkeypatch.setattr(memfabric.importlib.util, "find_spec",
                        lambda name, *a: object() if name == memfabric.PACKAGE else find_spec(name, *a))
    monkeypatch.setattr(memfabric.importlib, "import_module",
                        lambda name, *a: stand_in.module if name == memfabric.PACKAGE else import_module(name, *a))
    stand_in.store = tcp_store_server(1, host=LOOPBACK, timeout=timedelta(seconds=30))  # 127.0.0.1 only
    return stand_in


def run_scenario(fabric: StandInMemFabric, scenario: str) -> list:
    """Every rank (a thread) runs ``scenario`` of :mod:`pool_scenarios` on its memfabric view."""
    barrier = threading.Barrier(SIZE, timeout=60)
    results: list = [None] * SIZE
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        options = {"name": "mf", "store_url": STORE_URL, "rank": rank, "world_size": SIZE, "device_id": rank,
                   "store": fabric.store}
        ctx = Context("memfabric", rank, SIZE, options, barrier, threads=True, scenario=scenario)
        try:
            results[rank] = getattr(pool_scenarios, scenario)(ctx)
        except BaseException as exc:  # noqa: BLE001 - re-raised by the test
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"mf-rank{r}") for r in range(SIZE)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=90)
    assert not any(t.is_alive() for t in threads), f"memfabric/{scenario}: a rank did not finish"
    if errors:
        raise errors[0]
    return results


def test_roundtrip_bytes_metadata_through_the_documented_calls(fabric):
    results = run_scenario(fabric, "roundtrip")
    assert [r["checked"] for r in results] == [0, 6, 6]
    offsets = results[0]["offsets"]
    assert len(set(offsets)) == 6 and offsets[0] == 0
    # every rank left the big memory and shut MemFabric down when its pool closed
    assert sorted(fabric.calls) == sorted([(r, c) for r in range(SIZE) for c in ("destroy", "uninitialize")])
    assert fabric.hbm[STORE_URL] == {}


def test_release_backpressure_timeouts_and_concurrent_producers(fabric):
    out = run_scenario(fabric, "release")
    assert out[1]["ready_after_release"] is False and "[r]" in out[1]["double_release"]
    assert "[r]" in out[2]["get_released"]
    full = run_scenario(fabric, "backpressure")[0]
    assert "pool full" in full["full"] and "[b]" in full["full"] and 0.4 <= full["blocked_s"] < 20
    late = run_scenario(fabric, "timeouts")[1]
    assert "[late]" in late["late"][0] and "producer p0" in late["late"][0] and "memfabric backend" in late["late"][0]
    assert run_scenario(fabric, "concurrent")[-1]["got"] == 2 * pool_scenarios.ITEMS


def test_stale_forged_and_mismatched_handles_are_refused_naming_the_key(fabric):
    """The conformance suite's handle scenario (tests/pool/test_conformance.py) on memfabric."""
    producer, consumer = run_scenario(fabric, "handles")[:2]
    assert producer["offset_before"] == producer["offset_after"]
    for name, out in consumer["forged"].items():
        key = "never-put" if name == "key" else "h"
        assert out["type"] in ("BadHandle", "StaleHandle") and f"[{key}]" in out["error"], (name, out)
    assert consumer["stale_reput"]["type"] == "StaleHandle" and "[h]" in consumer["stale_reput"]["error"]
    assert consumer["stale_released"]["type"] == "StaleHandle" and "[g]" in consumer["stale_released"]["error"]


def test_put_lands_in_the_owners_contribution_and_get_reads_it_back(fabric):
    """The bytes sit in the producer's own HBM contribution at the handle's offset; a
    consumer with another bm rank reads them from there."""
    opened = []

    def open_rank(rank: int, owner: str):
        pool = open_pool("memfabric", capacity_bytes=4096, name="direct", owner=owner, store_url=STORE_URL,
                         rank=rank, world_size=2, device_id=rank, store=fabric.store)
        opened.append(pool)
        return pool

    producer_ready, consumed = threading.Event(), threading.Event()
    seen: dict = {}
    tensor = torch.arange(40, dtype=torch.int32).reshape(5, 8)

    def producer() -> None:
        pool = open_rank(1, "encoder0")
        pool.put("x", torch.zeros(3))  # so that the next object is not at offset 0
        seen["handle"] = pool.put("x2", tensor, {"sample_ids": [4, 2]})
        seen["space"] = fabric.hbm[STORE_URL][1].clone()
        producer_ready.set()
        consumed.wait(30)
        pool.close()

    def consumer() -> None:
        pool = open_rank(0, "backbone0")
        producer_ready.wait(30)
        handle = pool.handle("x2", timeout=10)
        seen["got"], seen["meta"] = pool.get(handle), handle.meta
        pool.release("x2")
        seen["ready"] = pool.ready("x2")
        consumed.set()
        pool.close()

    threads = [threading.Thread(target=producer), threading.Thread(target=consumer)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    handle = seen["handle"]
    assert handle.owner == "encoder0" and handle.offset > 0 and handle.nbytes == 160
    raw = seen["space"][handle.offset: handle.offset + handle.nbytes]
    assert raw.equal(tensor.view(-1).view(torch.uint8))
    assert seen["got"].equal(tensor) and seen["meta"] == {"sample_ids": [4, 2]} and seen["ready"] is False
    assert all(p.closed for p in opened)


def test_a_failing_documented_call_is_refused_with_memfabrics_message_and_cleaned_up(fabric):
    with pytest.raises(BackendUnavailable, match=r"MemFabric bm.initialize against tcp://127.0.0.1:18570 failed with "
                                                 r"code -1: rank_id 5 not in world of 2"):
        open_pool("memfabric", capacity_bytes=1024, store_url=STORE_URL, rank=5, world_size=2, device_id=0,
                  store=fabric.store)
    assert fabric.calls == [(None, "uninitialize")]
    with pytest.raises(BackendUnavailable,
                       match=r"bm.create of 2097152 bytes of HBM failed \(create bm handle failed"):
        open_pool("memfabric", capacity_bytes=1024, store_url=STORE_URL, rank=0, world_size=1, device_id=0,
                  store=fabric.store, bm_id=64)


def test_reading_from_a_producer_that_left_names_it(fabric):
    pool = open_pool("memfabric", capacity_bytes=1024, name="gone", owner="p7", store_url=STORE_URL, rank=0,
                     world_size=1, device_id=0, store=fabric.store)
    handle = pool.put("k", torch.ones(4))
    pool.close()
    reader = open_pool("memfabric", capacity_bytes=1024, name="gone", owner="p8", store_url=STORE_URL, rank=0,
                       world_size=1, device_id=0, store=fabric.store)
    try:
        with pytest.raises(PoolError, match=r"pool get \[k\]: producer p7 has no MemFabric rank"):
            reader.get(handle)
    finally:
        reader.close()


def test_missing_options_are_named(fabric, monkeypatch):
    monkeypatch.delenv("MINDSPEED_FLOW_MEMFABRIC_STORE_URL", raising=False)
    with pytest.raises(ValueError, match=r"pass store_url= .* or export MINDSPEED_FLOW_MEMFABRIC_STORE_URL"):
        open_pool("memfabric", capacity_bytes=1024, rank=0, world_size=1, device_id=0, store=fabric.store)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(ValueError, match=r"pass device_id= \(it defaults to \$LOCAL_RANK, which is not set\)"):
        open_pool("memfabric", capacity_bytes=1024, store_url=STORE_URL, rank=0, world_size=1, store=fabric.store)
