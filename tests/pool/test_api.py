"""The pool's job-facing edges: ``--flow-pool-backend`` picks the backend a job opens,
``mindspeed-flow doctor`` says which backends can run here and why not, and bad input
(metadata that would not round-trip, objects larger than the capacity) is refused naming
the key."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from mindspeed_flow.config import add_flow_arguments
from mindspeed_flow.doctor import pool_report
from mindspeed_flow.pool import PoolFull, open_pool
from mindspeed_flow.pool.job import open_job_pool
from mindspeed_flow.pool.local import drop


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flow_arguments(parser)
    return parser.parse_args(argv)


def test_flag_selects_the_backend(tmp_path):
    pool = open_job_pool(_args(["--flow-pool-backend", "shm"]), 1 << 12, environ={}, name=f"job-{tmp_path.name}")
    try:
        assert pool.backend == "shm"
        assert pool.get(pool.put("k", torch.arange(3))).equal(torch.arange(3))
    finally:
        pool.close()
        from mindspeed_flow.pool.shm import destroy

        destroy(f"job-{tmp_path.name}")
    local = open_job_pool(_args(["--flow-pool-backend", "local"]), 1 << 12, environ={}, name="job-local")
    assert local.backend == "local"
    local.close()
    drop("job-local")
    with pytest.raises(ValueError, match="did not ask for a pool"):
        open_job_pool(_args([]), 1 << 12, environ={})


def test_doctor_reports_each_backend(monkeypatch):
    """The same on every machine, with the mooncake package or without it: each reason is
    planted (the package importable but no master binary; then the package missing)."""
    report = pool_report()
    assert "local      can run here" in report and "memfabric  cannot run here" in report
    import mindspeed_flow.pool.mooncake as mooncake
    from mindspeed_flow.pool import BackendUnavailable

    monkeypatch.setattr(mooncake, "import_store", lambda: (object, object))  # as if installed
    monkeypatch.setattr(mooncake, "master_binary", lambda: None)
    assert "mooncake   cannot run here: mooncake_master is not on PATH" in pool_report()

    def missing():
        raise BackendUnavailable("pool backend 'mooncake': cannot import mooncake.store (planted)")

    monkeypatch.setattr(mooncake, "import_store", missing)
    assert "mooncake   cannot run here: pool backend 'mooncake': cannot import mooncake.store (planted)" in pool_report()


def test_bad_input_is_refused_naming_the_key():
    pool = open_pool("local", capacity_bytes=256, name="bad-input", owner="p0")
    try:
        with pytest.raises(TypeError, match=r"pool put \[m\]: metadata does not round-trip"):
            pool.put("m", torch.ones(1), {"sample_ids": (1, 2)})
        with pytest.raises(PoolFull, match=r"pool put \[big\] by p0: 400 bytes exceed"):
            pool.put("big", torch.ones(100))
        pool.put("k", torch.ones(1))
        with pytest.raises(KeyError, match=r"\[k\].*already in the pool"):
            pool.put("k", torch.ones(1))
    finally:
        pool.close()
        drop("bad-input")


def _tensor_parallel_pool(rank, world_size):
    """Rank 0 (the TP leader) holds a local pool; both ranks get through the TP view."""
    import torch.distributed as dist

    from mindspeed_flow.pool import PoolError
    from mindspeed_flow.pool.tensor_parallel import TensorParallelPool

    group = dist.new_group([0, 1])
    pool = open_pool("local", capacity_bytes=1 << 12, name=f"tpview{os.getpid()}", owner="p0") if rank == 0 else None
    view = TensorParallelPool(pool, group, leader=0)
    if rank == 0:
        view.put("k", torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), {"m": 1})
    dropped = view.put("k2", torch.ones(2))  # the follower's put is dropped, the leader's kept
    got = view.get("k", timeout=10)
    view.release("k")
    try:
        view.get("missing", timeout=0.2)
    except PoolError as exc:
        error = f"{type(exc).__name__}: {exc}"
    try:
        TensorParallelPool(None if rank else pool, group, leader=1)
    except ValueError as exc:
        refused = str(exc)
    dist.barrier()
    out = {"got": got, "dropped": dropped, "error": error, "refused": refused,
           "left": pool.ready("k") if pool else None, "k2": pool.ready("k2") if pool else None}
    if pool is not None:
        pool.close()
    return out


def test_tensor_parallel_pool_broadcasts_the_leaders_gets_and_errors():
    from megatron_cpu_harness import launch

    leader, follower = launch(_tensor_parallel_pool, 2, timeout_s=120)
    for out in (leader, follower):
        assert out["got"].equal(torch.arange(12, dtype=torch.bfloat16).reshape(3, 4))
    assert follower["dropped"] is None and leader["k2"] is True and leader["left"] is False
    assert leader["error"].startswith("PoolTimeout: pool get [missing]")
    assert follower["error"].startswith("PoolError: pool get [missing] by TP leader rank 0 failed: PoolTimeout")
    assert "the leader (rank 1) and only it opens the pool" in leader["refused"] + follower["refused"]


def test_memfabric_is_refused_with_its_reason_on_every_machine(tmp_path, monkeypatch):
    """Off Ascend: no driver.  With a stand-in driver directory (the one thing that cannot
    exist here): the missing package, then - the package found but not importable - the
    import error (the data path itself: tests/pool/test_memfabric.py)."""
    import importlib.util

    from mindspeed_flow.pool import BackendUnavailable
    from mindspeed_flow.pool import memfabric

    monkeypatch.setattr(memfabric, "ASCEND_DRIVER", tmp_path / "no-driver")
    with pytest.raises(BackendUnavailable, match="no Ascend driver .* runs only on Ascend NPUs"):
        open_pool("memfabric", capacity_bytes=1024)
    monkeypatch.setattr(memfabric, "ASCEND_DRIVER", tmp_path)  # stand-in for /usr/local/Ascend/driver
    if importlib.util.find_spec("memfabric_hybrid") is None:
        with pytest.raises(BackendUnavailable, match="memfabric_hybrid is not installed"):
            open_pool("memfabric", capacity_bytes=1024)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "memfabric_hybrid" else real_find_spec(name, *a))
    with pytest.raises(BackendUnavailable, match="cannot import memfabric_hybrid .*set_env.sh"):
        open_pool("memfabric", capacity_bytes=1024)


def test_a_get_refuses_bytes_that_were_released_and_overwritten_while_it_read():
    """The check after the read: the object is released and another put reuses its bytes
    while a get is copying them; the get refuses (naming the key) instead of returning a
    mix of both objects."""
    from mindspeed_flow.pool import StaleHandle

    pool = open_pool("local", capacity_bytes=1024, name="reread", owner="p0")
    try:
        handle = pool.put("k", torch.zeros(100))
        real_read = pool.read

        def read_then_overwrite(h):
            payload = real_read(h)
            pool.release("k")
            assert pool.put("k", torch.ones(100)).offset == h.offset  # the same bytes, reused
            return payload

        pool.read = read_then_overwrite
        with pytest.raises(StaleHandle, match=r"pool get \[k\]: stale handle .*released and put again while it was "
                                              r"being read"):
            pool.get(handle)
        pool.read = real_read
        assert pool.get("k").equal(torch.ones(100))
    finally:
        pool.close()
        drop("reread")
