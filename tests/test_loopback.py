"""Every server the project starts listens on 127.0.0.1 (or ::1) only, checked in the
kernel's socket table (``/proc/net/tcp*`` mapped to this test's own processes through
``/proc/<pid>/fd``): the train job's store and ranks, the benchmark's and the test
harnesses' launches, the pool backends, Mooncake's master.  Where a server cannot be bound
(a Mooncake client, torchrun's own store) the test pins down exactly which listeners those
are, and that the backend refuses to start without the user's opt-in (docs/pool.md)."""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_flow.loopback import beyond_loopback, descendants, is_loopback, listening_sockets
from subprocess_utils import last_json

ROOT = Path(__file__).resolve().parents[1]


def _tree_listeners(root_pid: int) -> list[dict]:
    return [{"host": item.host, "port": item.port, "pids": list(item.pids)}
            for item in listening_sockets(descendants(root_pid))]


def _wide(listeners: list[dict]) -> list[dict]:
    return [item for item in listeners if not is_loopback(item["host"])]


def test_the_socket_table_tells_wildcard_from_loopback_listeners():
    with socket.socket() as wide, socket.socket() as local, socket.socket(socket.AF_INET6) as local6:
        wide.bind(("0.0.0.0", 0))
        local.bind(("127.0.0.1", 0))
        local6.bind(("::1", 0))
        for sock in (wide, local, local6):
            sock.listen()
        mine = {(item.host, item.port) for item in listening_sockets([os.getpid()])}
        assert {("0.0.0.0", wide.getsockname()[1]), ("127.0.0.1", local.getsockname()[1]),
                ("::1", local6.getsockname()[1])} <= mine
        assert [item.port for item in beyond_loopback([os.getpid()])] == [wide.getsockname()[1]]
    assert is_loopback("::ffff:127.0.0.1") and not is_loopback("::") and not is_loopback("0.0.0.0")


def test_tcp_store_server_binds_loopback_where_torch_binds_every_interface():
    from datetime import timedelta

    import torch.distributed as dist

    from mindspeed_flow.loopback import tcp_store_server

    plain = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    try:  # what the audit saw: torch ignores the host for its server socket
        assert any(item.port == plain.port for item in beyond_loopback([os.getpid()]))
    finally:
        del plain
    store = tcp_store_server(2, timeout=timedelta(seconds=30))
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=timedelta(seconds=30))
    client.set("k", "v")
    assert store.get("k") == b"v"
    ours = [item for item in listening_sockets([os.getpid()]) if item.port == store.port]
    assert [item.host for item in ours] == ["127.0.0.1"]


# ---------------------------------------------------------------------- launches


def _report_tree(env, emit):
    """A train-job worker: rank 0 reads the listeners of the whole launch (the parent holds
    the store) while every rank is in the group."""
    import torch.distributed as dist

    dist.barrier()
    out = _tree_listeners(os.getppid()) if env.rank == 0 else None
    dist.barrier()
    return out


def test_train_job_store_and_ranks_listen_on_loopback_only():
    from mindspeed_flow.train.launch import run_world

    results, _ = run_world(_report_tree, 2, megatron=False, timeout_s=120)
    listeners = results[0]
    assert any(os.getpid() in item["pids"] for item in listeners), listeners  # the parent's store was seen
    assert len({p for item in listeners for p in item["pids"]}) >= 3, listeners  # ... and both ranks' gloo
    assert _wide(listeners) == [], listeners


def _report_tree_after_collective(env, emit):
    """As ``_report_tree``, after a collective on the rank's device (NCCL sets up its
    bootstrap sockets lazily, at the first collective)."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(1, device=env.device)
    dist.all_reduce(tensor)
    out = _tree_listeners(os.getppid()) if env.rank == 0 else None
    dist.barrier()
    return {"listeners": out, "backend": env.backend}


def test_train_job_on_gpus_keeps_nccl_on_loopback():
    """On a machine with a CUDA GPU the spawned ranks use NCCL: its bootstrap listens on
    loopback too (``NCCL_SOCKET_IFNAME=lo`` unless the user set it)."""
    from mindspeed_flow.train.launch import cuda_usable, run_world

    if not cuda_usable(1):
        pytest.skip("needs a CUDA GPU (the NCCL path of the train job)")
    results, _ = run_world(_report_tree_after_collective, 1, megatron=False, timeout_s=300)
    assert results[0]["backend"] == "nccl"
    assert _wide(results[0]["listeners"]) == [], results[0]


def _report_tree_bench(rank, world):
    import torch.distributed as dist

    dist.barrier()
    out = _tree_listeners(os.getppid()) if rank == 0 else None
    dist.barrier()
    return out


def _load_script(name: str):
    """``scripts/<name>.py`` as the module ``name`` (spawned children import it by name:
    spawn hands them this process's ``sys.path``)."""
    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    return importlib.import_module(name)


@pytest.mark.parametrize("launcher", ["bench_decoupled", "megatron_cpu_harness"])
def test_benchmark_and_harness_launches_listen_on_loopback_only(launcher):
    if launcher == "bench_decoupled":
        launch = _load_script("bench_decoupled").launch
    else:
        from megatron_cpu_harness import launch
    listeners = launch(_report_tree_bench, 2, timeout_s=120)[0]
    assert any(os.getpid() in item["pids"] for item in listeners), listeners
    assert _wide(listeners) == [], listeners


@pytest.mark.parametrize("backend", ["local", "shm", "torch"])
def test_pool_backends_listen_on_loopback_only(backend):
    from pool_cluster import Cluster

    group = Cluster(backend, 2, {"name": f"loop{os.getpid()}"})
    try:
        listeners = group.run("listeners")[0]
    finally:
        group.stop()
        if backend == "shm":
            from mindspeed_flow.pool.shm import destroy

            destroy(f"loop{os.getpid()}")
    if backend == "torch":
        assert len({p for item in listeners for p in item["pids"]}) >= 3, listeners  # store + both ranks
    assert _wide(listeners) == [], listeners


_TORCHRUN_RANK = r'''
import json, os, sys
from mindspeed_flow.loopback import descendants, listening_sockets
from mindspeed_flow.train.launch import run_world

def worker(env, emit):
    import torch.distributed as dist
    dist.barrier()
    agent = os.getppid()
    out = [{"host": i.host, "port": i.port, "pids": list(i.pids)} for i in listening_sockets(descendants(agent))]
    dist.barrier()
    return {"agent": agent, "listeners": out, "me": os.getpid()}

launched = run_world(worker, 2, megatron=False, timeout_s=120)
if launched is not None:
    with open(sys.argv[1], "w") as f:
        json.dump(launched[0], f)
'''


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _without_switches() -> dict:
    """This environment without the plugin's switch and without a gloo interface."""
    return {k: v for k, v in os.environ.items() if k not in ("MINDSPEED_FLOW_FLAGS", "GLOO_SOCKET_IFNAME")}


def _torchrun(tmp_path, source: str, *args: str, env: dict | None = None):
    """``torchrun --nproc-per-node 2 --master-addr 127.0.0.1 rank.py OUT ARGS`` (``source``
    writes its report to OUT): the master port and the report."""
    script, out, port = tmp_path / "rank.py", tmp_path / "out.json", _free_port()
    script.write_text(source)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                           "127.0.0.1", "--master-port", str(port), str(script), str(out), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return port, json.loads(out.read_text())


def test_torchrun_launch_adds_no_listener_beyond_torchruns_own_store(tmp_path):
    """Without the plugin the rendezvous store of a torchrun launch is torch's own (its
    agent's): torch binds it on every interface whatever ``--master-addr`` says (docs/pool.md;
    with the plugin's flags see the next test).  The job itself adds nothing beyond loopback:
    every wide listener of the launch is held by the agent alone, none by a rank."""
    (rank0, rank1) = _torchrun(tmp_path, _TORCHRUN_RANK)[1]
    agent, listeners = rank0["agent"], rank0["listeners"]
    ranks = {rank0["me"], rank1["me"]}
    assert {p for item in listeners for p in item["pids"]} & ranks == ranks, listeners  # the ranks' gloo was seen
    assert all(item["pids"] == [agent] for item in _wide(listeners)), listeners  # torch's store, in the agent only
    assert all(is_loopback(item["host"]) for item in listeners if set(item["pids"]) & ranks), listeners


_TORCHRUN_PLAIN_RANK = r"""
import json, os, sys
import torch.distributed as dist
from mindspeed_flow.loopback import descendants, listening_sockets

dist.init_process_group("gloo")  # env:// from torchrun: clients of the agent's store
dist.barrier()
agent = os.getppid()
out = [{"host": i.host, "port": i.port, "pids": list(i.pids)} for i in listening_sockets(descendants(agent))]
dist.barrier()
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        json.dump({"agent": agent, "listeners": out, "gloo": os.environ.get("GLOO_SOCKET_IFNAME")}, f)
dist.destroy_process_group()
"""


def test_torchrun_launch_with_the_plugins_flags_listens_on_loopback_only(tmp_path):
    """With the plugin's flag on torchrun's command line the ``.pth`` hook activates the plugin
    in the agent too, before its rendezvous: the agent's store (``--master-addr 127.0.0.1``)
    and both gloo ranks listen on loopback only."""
    port, report = _torchrun(tmp_path, _TORCHRUN_PLAIN_RANK, "--flow-fused-attn", env=_without_switches())
    listeners, agent = report["listeners"], report["agent"]
    assert any(item["port"] == port and agent in item["pids"] for item in listeners), listeners  # the store
    assert len({p for item in listeners for p in item["pids"]}) >= 3, listeners  # ... and both ranks' gloo
    assert _wide(listeners) == [], listeners
    assert report["gloo"] == "lo"


_ENV_RANK0 = r"""
import json, os, sys
import torch.distributed as dist
from mindspeed_flow.loopback import listening_sockets

dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
print(json.dumps([{"host": i.host, "port": i.port, "pids": list(i.pids)} for i in listening_sockets([os.getpid()])]))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("init", ["env://", "tcp://127.0.0.1:{port}", "tcp://localhost:{port}"])
def test_launcher_keeps_rank0s_init_process_group_store_on_loopback(tmp_path, init):
    """``python -m mindspeed_flow.launch SCRIPT``: rank 0's store of ``init_process_group``
    (``env://`` with MASTER_ADDR=127.0.0.1, ``tcp://``) listens on loopback only."""
    script = tmp_path / "rank0.py"
    script.write_text(_ENV_RANK0)
    port = _free_port()
    env = {**_without_switches(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    proc = subprocess.run([sys.executable, "-m", "mindspeed_flow.launch", str(script), init.format(port=port)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    listeners = last_json(proc)
    assert any(item["port"] == port for item in listeners), listeners
    assert _wide(listeners) == [], listeners


def test_store_factory_passes_non_loopback_hosts_and_clients_through_unchanged():
    from datetime import timedelta

    from mindspeed_flow.loopback import loopback_store_factory

    calls = []

    def torch_store(*args, **kwargs):
        calls.append((args, kwargs))
        return "store"

    store = loopback_store_factory(torch_store)
    as_given = [(("10.1.2.3", 29500, 2, True, timedelta(seconds=5)), {"multi_tenant": True}),
                (("node-0.example", 0), {"is_master": True, "wait_for_workers": False, "use_libuv": False}),
                (("0.0.0.0", 29500, 2, True), {}),
                (("127.0.0.1", 29500, 2, False), {}),  # a client
                (("127.0.0.1", 29500), {"is_master": True, "master_listen_fd": 7})]  # the caller's own socket
    for args, kwargs in as_given:
        assert store(*args, **kwargs) == "store"
    assert calls == as_given
    calls.clear()
    with socket.socket() as busy:  # a port this process cannot bind: torch's own call decides
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        store("127.0.0.1", taken, 1, True)
    assert calls == [(("127.0.0.1", taken, 1, True), {})]
    calls.clear()
    store("127.0.0.1", 0, 1, True, timedelta(seconds=5), wait_for_workers=False, use_libuv=False)
    (args, kwargs), = calls
    os.close(kwargs.pop("master_listen_fd"))
    assert args[0] == "127.0.0.1" and args[1] > 0 and args[2:] == (1, True, timedelta(seconds=5))
    assert kwargs == {"wait_for_workers": False, "use_libuv": False}


def test_keep_stores_on_loopback_is_idempotent_and_remove_restores_torchs_names():
    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend  # noqa: F401
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous  # noqa: F401
    import torch.distributed.elastic.rendezvous.static_tcp_rendezvous  # noqa: F401
    import torch.distributed.rendezvous  # noqa: F401

    from mindspeed_flow.loopback import DYNAMIC_HANDLER, STORE_NAMES, keep_stores_on_loopback

    handler = sys.modules[DYNAMIC_HANDLER[0]].DynamicRendezvousHandler
    torchs_method = handler.__dict__[DYNAMIC_HANDLER[2]]

    def names():
        return [getattr(sys.modules[module], name) for module, name in STORE_NAMES] + \
            [handler.__dict__[DYNAMIC_HANDLER[2]]]

    assert names() == [dist.TCPStore] * len(STORE_NAMES) + [torchs_method]
    installed = keep_stores_on_loopback()
    try:
        assert keep_stores_on_loopback() is installed
        wrapped = names()
        assert all(item.__wrapped__ is dist.TCPStore for item in wrapped[:-1]), wrapped
        assert wrapped[-1].__wrapped__ is torchs_method
        # a real store through the rebound name: bound to loopback; a non-loopback host: torch's
        store = sys.modules["torch.distributed.rendezvous"].TCPStore("127.0.0.1", 0, 1, True)
        assert [item.host for item in listening_sockets([os.getpid()]) if item.port == store.port] == ["127.0.0.1"]
        wide = sys.modules[STORE_NAMES[1][0]].TCPStore("0.0.0.0", 0, 1, True)
        assert any(item.port == wide.port for item in beyond_loopback([os.getpid()]))
        del store, wide
    finally:
        installed.remove()
    assert names() == [dist.TCPStore] * len(STORE_NAMES) + [torchs_method]


# ---------------------------------------------------------------------- mooncake


def _mooncake_or_fail():
    from mindspeed_flow.pool.availability import backend_status

    reason = backend_status()["mooncake"]
    if reason is not None:
        pytest.fail(f"pool backend mooncake cannot run here: {reason}")


def test_mooncake_master_listens_on_loopback_only(tmp_path):
    _mooncake_or_fail()
    from mindspeed_flow.pool.mooncake import MooncakeServer

    with MooncakeServer(log=tmp_path / "master.log") as server:
        listeners = _tree_listeners(server.process.pid)
        ports = {item["port"] for item in listeners}
        assert {server.rpc_port, server.metrics_port} <= ports, listeners
        assert _wide(listeners) == [], listeners


_MOONCAKE_CLIENT = r'''
import json, os, sys
from mindspeed_flow.loopback import beyond_loopback
from mindspeed_flow.pool import BackendUnavailable, open_pool
options = json.loads(sys.argv[1])
try:
    open_pool("mooncake", capacity_bytes=1 << 20, name="loop", **options)
    refused = None
except BackendUnavailable as exc:
    refused = str(exc)
before = beyond_loopback([os.getpid()])
pool = open_pool("mooncake", capacity_bytes=1 << 20, name="loop", listen_beyond_loopback=True, **options)
wide = sorted(f"{i.host}:{i.port}" for i in beyond_loopback([os.getpid()]))
print(json.dumps({"refused": refused, "before": [str(i) for i in before], "wide": wide,
                  "reported": sorted(f"{i.host}:{i.port}" for i in pool.wide_listeners)}))
pool.close()
os._exit(0)  # Mooncake's client threads do not always let the interpreter end
'''


def test_mooncake_client_is_refused_unless_opted_in_and_names_what_it_opens(tmp_path):
    """No Mooncake option binds a client's listeners (the transfer engine's handshake port
    and its TCP transport): without the opt-in the backend refuses to start; with it, those
    are the only listeners beyond loopback, and the pool names them."""
    _mooncake_or_fail()
    from mindspeed_flow.pool.mooncake import OPT_IN_ENV, MooncakeServer

    with MooncakeServer(log=tmp_path / "master.log") as server:
        env = {k: v for k, v in os.environ.items() if k != OPT_IN_ENV}
        proc = subprocess.run([sys.executable, "-c", _MOONCAKE_CLIENT, json.dumps(server.options)], env=env,
                              capture_output=True, text=True, timeout=120)
        out = last_json(proc)
        assert _wide(_tree_listeners(server.process.pid)) == []
    assert OPT_IN_ENV in out["refused"] and "listen_beyond_loopback=True" in out["refused"], out
    assert out["before"] == [] and out["wide"] and out["wide"] == out["reported"], out


def test_mooncake_opt_in_from_the_environment():
    from mindspeed_flow.pool.mooncake import OPT_IN_ENV, listen_opt_in

    assert not listen_opt_in(None, {}) and listen_opt_in(None, {OPT_IN_ENV: "1"})
    assert not listen_opt_in(False, {OPT_IN_ENV: "1"}) and listen_opt_in(True, {})
