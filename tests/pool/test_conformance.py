"""The pool conformance suite: the same scenarios (:mod:`pool_scenarios`) on every backend
that can run here: ``local`` (threads), ``shm`` and ``mooncake`` (processes), ``torch``
(processes in a gloo group).  Mooncake's master and metadata server are started on
127.0.0.1 by the fixture and stopped by it."""

from __future__ import annotations

import os

import pytest

from mindspeed_flow.pool import BackendUnavailable, open_pool
from mindspeed_flow.pool.availability import backend_status
from pool_cluster import Cluster

PROCESS_BACKENDS = ["local", "shm", "torch", "mooncake"]
SIZE = 3


@pytest.fixture(scope="module", params=PROCESS_BACKENDS)
def cluster(request, tmp_path_factory):
    backend = request.param
    reason = backend_status()[backend]
    if reason is not None:
        pytest.fail(f"pool backend {backend} cannot run here: {reason}")
    name = f"conf{os.getpid()}"
    options: dict = {"name": name}
    server = None
    if backend == "mooncake":
        from mindspeed_flow.pool.mooncake import MooncakeServer

        server = MooncakeServer(log=tmp_path_factory.mktemp("mooncake") / "master.log")
        request.addfinalizer(server.stop)
        # opted in: a Mooncake client listens beyond loopback whatever it is told (docs/pool.md)
        options.update(server.options, listen_beyond_loopback=True)
    group = Cluster(backend, SIZE, options)
    request.addfinalizer(group.stop)
    if backend == "shm":
        from mindspeed_flow.pool.shm import destroy

        request.addfinalizer(lambda: destroy(name))
    return group


def test_roundtrip_bytes_and_metadata(cluster):
    results = cluster.run("roundtrip")
    assert [r["checked"] for r in results] == [0, 6, 6]
    offsets = results[0]["offsets"]
    assert len(set(offsets)) == 6 and offsets[0] == 0  # six distinct addresses in rank 0's segment


def test_backpressure_blocks_and_never_evicts(cluster):
    out = cluster.run("backpressure")[0]
    assert "pool full" in out["full"] and "[b]" in out["full"] and "a" in out["full"].split(":")[-2]
    assert 0.25 <= out["full_after_s"] < 5
    assert 0.4 <= out["blocked_s"] < 20  # released by the consumer after 0.5 s


def test_get_timeout_names_key_and_producer(cluster):
    out = cluster.run("timeouts")[1]
    message, waited = out["late"]
    producer = "rank0" if cluster.backend == "torch" else "p0"
    assert "[late]" in message and f"producer {producer}" in message and 0.45 <= waited < 5
    message, waited = out["nobody"]
    assert "[nobody]" in message and "no producer has announced it" in message
    assert out["ready"] == ["w1", "w2"]


def test_release_frees_space_and_key(cluster):
    out = cluster.run("release")
    assert out[1]["ready_after_release"] is False and "[r]" in out[1]["double_release"]
    assert "[r]" in out[2]["get_released"]


def test_stale_forged_and_mismatched_handles_are_refused_naming_the_key(cluster):
    producer, consumer = cluster.run("handles")[:2]
    assert producer["offset_before"] == producer["offset_after"]  # the new object reuses the old bytes
    for name, out in consumer["forged"].items():
        key = "never-put" if name == "key" else "h"
        expected = "StaleHandle" if name in ("key", "version") else "BadHandle"
        assert out["type"] == expected and f"[{key}]" in out["error"], (name, out)
        assert "refused" in out["error"], (name, out)
    assert "shape (7, 7) (pool: (250,))" in consumer["forged"]["shape"]["error"]
    assert "owner" in consumer["forged"]["owner"]["error"] and "offset" in consumer["forged"]["offset"]["error"]
    for name in ("stale_reput", "stale_released"):
        out = consumer[name]
        assert out["type"] == "StaleHandle" and "stale handle" in out["error"], (name, out)
    assert "[h]" in consumer["stale_reput"]["error"] and "released and put again" in consumer["stale_reput"]["error"]
    assert "[g]" in consumer["stale_released"]["error"] and "was released" in consumer["stale_released"]["error"]
    if cluster.backend == "torch":
        out = consumer["owner_refuses"]
        assert out["type"] == "BadHandle" and "producer rank0 refused the request" in out["error"], out


def test_concurrent_producers(cluster):
    assert cluster.run("concurrent")[-1]["got"] == 2 * 8


def test_producer_death_is_reported_naming_it(cluster):
    """Last on purpose: rank 0 ends here."""
    results = cluster.run("producer_death", timeout_s=60)
    producer = "rank0" if cluster.backend == "torch" else "p0"
    assert results[0] == "died"
    for out in results[1:]:
        assert f"producer {producer}" in out["error"] and "[doomed]" in out["error"]
        assert out["after_s"] < 10  # liveness 2 s; the get's timeout is 30 s


def test_unknown_and_unavailable_backends_fail_clearly():
    with pytest.raises(ValueError, match="unknown backend 'nvme'"):
        open_pool("nvme")
    if not os.path.isdir("/usr/local/Ascend/driver"):
        with pytest.raises(BackendUnavailable, match="no Ascend driver"):
            open_pool("memfabric", capacity_bytes=1024)


def test_torch_producer_death_mid_read():
    """The review's case on the ``torch`` backend: the producer dies while the consumer is
    reading (its request taken, its receive posted); the consumer's get fails naming the
    producer within the liveness window, not after its 30 s timeout."""
    reason = backend_status()["torch"]
    if reason is not None:
        pytest.fail(f"pool backend torch cannot run here: {reason}")
    group = Cluster("torch", 2, {"name": f"midread{os.getpid()}"})
    try:
        died, out = group.run("producer_death_mid_read", timeout_s=60)
    finally:
        group.stop()
    assert died == "died"
    assert "producer rank0" in out["error"] and "[mid]" in out["error"], out["error"]
    assert out["after_s"] < 10, out  # liveness 2 s
