"""``mooncake``: Mooncake Store (``mooncake-transfer-engine-non-cuda``).

Every participant is a Mooncake client that mounts a segment of ``capacity_bytes`` (plus
headroom for the index) and puts its objects into *its own* segment
(``preferred_segment``), hard-pinned, so the master never evicts an object nobody
consumed; the pool's own accounting (:class:`~.arena.Arena`) gives the back-pressure.
Handles, claims and heartbeats are small Mooncake objects too.  A producer must stay alive
(its segment mounted) while consumers read what it put.

:class:`MooncakeServer` starts ``mooncake_master`` on 127.0.0.1 (tests, benchmarks and one-node
jobs); a cluster passes ``master``/``metadata``.

Where it listens (mooncake-transfer-engine-non-cuda 0.3.13, read in its source and checked in
the kernel's socket table, ``tests/test_loopback.py``):

- the master's RPC and metrics servers honour ``-rpc_address`` / ``-metrics_host``: 127.0.0.1;
- the master's HTTP metadata server ignores ``-http_metadata_server_host`` (it is built on
  ``coro_http_server(threads, port)``, which binds 0.0.0.0), so it is not started: clients
  exchange their metadata peer to peer (``metadata="P2PHANDSHAKE"``, Mooncake's documented
  alternative to a metadata server);
- every client opens two listeners that no option binds: the transfer engine's handshake/RPC
  port (``findAvailableTcpPort``: ``INADDR_ANY``) and the TCP transport's acceptor (IPv6
  dual-stack ``::``).  ``MC_TCP_BIND_ADDRESS`` only sets the address a client *advertises*.
  Whoever reaches those ports can read and write the client's segment, so
  :class:`MooncakePool` refuses to start unless the user opts in to listening beyond
  loopback (``listen_beyond_loopback=True`` or ``MINDSPEED_FLOW_MOONCAKE_LISTEN_BEYOND_LOOPBACK=1``).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..loopback import LOOPBACK, beyond_loopback
from .base import Pool
from .errors import BackendUnavailable, PoolError
from .handle import Handle

log = logging.getLogger(__name__)

OPT_IN_ENV = "MINDSPEED_FLOW_MOONCAKE_LISTEN_BEYOND_LOOPBACK"
P2P_METADATA = "P2PHANDSHAKE"  # no metadata server: clients exchange segment metadata themselves
INDEX_HEADROOM = 4 << 20  # handles, claims, heartbeats: a few hundred bytes each
MIN_SEGMENT = 16 << 20  # Mooncake refuses smaller segments and buffers


def master_binary() -> str | None:
    """``mooncake_master`` next to this interpreter (a venv's bin) or on ``PATH``."""
    local = Path(sys.executable).with_name("mooncake_master")
    return str(local) if local.exists() else shutil.which("mooncake_master")


def import_store():
    """Mooncake's Python client, or a clear reason why not."""
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:
        raise BackendUnavailable(
            f"pool backend 'mooncake': cannot import mooncake.store ({exc}); install "
            "`pip install mindspeed-flow[mooncake]` and Debian's libibverbs1 (apt-get install libibverbs1)") from None
    return MooncakeDistributedStore, ReplicateConfig


class _MooncakeIndex:
    """The index as small hard-pinned objects in the same store (``upsert`` to overwrite).

    A participant's entries live in its own segment like its data: a write never lands in
    another (possibly dead) client's segment.  They vanish with it, which is why consumers
    remember the claims they saw."""

    def __init__(self, pool: "MooncakePool") -> None:
        self.pool = pool

    def set(self, key: str, value: bytes) -> None:
        self.pool.check(self.pool.store.upsert(self.name(key), value, self.pool.config), "upsert", key)

    def get(self, key: str) -> bytes | None:
        if not self.has(key):
            return None
        value = self.pool.store.get(self.name(key))
        return bytes(value) if value else None

    def delete(self, key: str) -> None:
        self.pool.store.remove(self.name(key), True)

    def has(self, key: str) -> bool:
        return self.pool.store.is_exist(self.name(key)) == 1

    def name(self, key: str) -> str:
        return f"{self.pool.name}/idx/{key}"


def listen_opt_in(listen_beyond_loopback: bool | None, environ=os.environ) -> bool:
    """Whether the user accepts a Mooncake client listening on every interface."""
    if listen_beyond_loopback is not None:
        return bool(listen_beyond_loopback)
    return environ.get(OPT_IN_ENV, "") == "1"


class MooncakePool(Pool):
    """Args (besides :class:`~.base.Pool`'s): ``master`` (``host:port`` of
    ``mooncake_master``), ``metadata`` (its HTTP metadata URL, or ``P2PHANDSHAKE``, the
    default: no metadata server), ``owner`` (default ``pid<pid>``), ``hostname`` (this
    client's address, default 127.0.0.1), ``listen_beyond_loopback`` (default
    ``$MINDSPEED_FLOW_MOONCAKE_LISTEN_BEYOND_LOOPBACK == "1"``): must be true, because a
    Mooncake client listens on every interface whatever it is told (module docstring)."""

    backend = "mooncake"

    def __init__(self, capacity_bytes: int, *, master: str, metadata: str = P2P_METADATA, name: str = "pool",
                 owner: str | None = None, hostname: str = LOOPBACK, listen_beyond_loopback: bool | None = None,
                 **options) -> None:
        if not listen_opt_in(listen_beyond_loopback):
            raise BackendUnavailable(
                "pool backend 'mooncake': a Mooncake client listens on every network interface (its transfer "
                "engine's handshake port and its TCP transport; Mooncake has no option to bind them to 127.0.0.1, "
                "MC_TCP_BIND_ADDRESS only sets the advertised address), and whoever reaches them can read and write "
                f"its segment; refused. Opt in with listen_beyond_loopback=True or {OPT_IN_ENV}=1 where the "
                "network is trusted (docs/pool.md)")
        store_cls, config_cls = import_store()
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname)
        self.name = name
        self.store = store_cls()
        segment = max(MIN_SEGMENT, capacity_bytes + INDEX_HEADROOM)
        before = set(beyond_loopback([os.getpid()]))
        rc = self.store.setup(hostname, metadata, segment, segment, "tcp", "", master)
        self.wide_listeners = sorted(set(beyond_loopback([os.getpid()])) - before, key=lambda item: item.port)
        if self.wide_listeners:
            log.warning("pool backend 'mooncake' (opted in): this client listens beyond loopback on %s",
                        ", ".join(f"{item.host}:{item.port}" for item in self.wide_listeners))
        if rc != 0:
            raise BackendUnavailable(f"pool backend 'mooncake': setup against master {master}, metadata "
                                     f"{metadata} failed with code {rc} (is mooncake_master running?)")
        self.config = config_cls()
        self.config.replica_num = 1
        self.config.with_hard_pin = True
        self.config.preferred_segment = self.store.get_hostname()
        super().__init__(_MooncakeIndex(self), owner or f"pid{os.getpid()}", capacity_bytes, **options)

    def check(self, rc: int, op: str, key: str) -> None:
        if rc != 0:
            raise PoolError(f"pool {op} [{key}] by {self.owner}: Mooncake returned {rc} (mooncake backend)")

    def write(self, handle: Handle, payload: torch.Tensor) -> None:
        """Into this owner's segment, hard-pinned (a released object's old bytes go first)."""
        self.store.remove(self._data_key(handle.key), True)
        self.check(self.store.put(self._data_key(handle.key), payload.numpy(), self.config), "put", handle.key)

    def put(self, key: str, tensor: torch.Tensor, meta: dict | None = None, *, timeout: float | None = None) -> Handle:
        if tensor.numel() == 0:
            raise ValueError(f"pool put [{key}]: Mooncake stores no empty objects (shape {tuple(tensor.shape)})")
        return super().put(key, tensor, meta, timeout=timeout)

    def _data_key(self, key: str) -> str:
        return f"{self.name}/data/{key}"

    def read(self, handle: Handle) -> torch.Tensor:
        data = self.store.get(self._data_key(handle.key))
        if not data:
            raise PoolError(f"pool get [{handle.key}]: Mooncake has no data for it (producer {handle.owner} "
                            "closed its segment or the object was released)")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def _released(self, keys):
        gone = super()._released(keys)
        for key in gone:
            self.store.remove(self._data_key(key), True)
        return gone

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self.store.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeServer:
    """``mooncake_master`` listening on 127.0.0.1 only (RPC and metrics ports of its own);
    no HTTP metadata server (Mooncake binds it to 0.0.0.0 whatever its host flag says):
    clients use ``P2PHANDSHAKE`` metadata.

    Use as a context manager; :attr:`options` are what :func:`open_pool` needs (plus the
    client's opt-in, ``listen_beyond_loopback``)."""

    def __init__(self, log: Path | None = None, start_timeout_s: float = 30.0) -> None:
        binary = master_binary()
        if binary is None:
            raise BackendUnavailable("pool backend 'mooncake': no mooncake_master executable (pip install "
                                     "mindspeed-flow[mooncake])")
        self.rpc_port, self.metrics_port = _free_port(), _free_port()
        self.log = log
        out = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            [binary, f"-rpc_address={LOOPBACK}", f"-rpc_port={self.rpc_port}", "-enable_http_metadata_server=false",
             f"-metrics_host={LOOPBACK}", f"-metrics_port={self.metrics_port}"],
            stdout=out, stderr=subprocess.STDOUT)
        self._out = out
        try:
            self._wait(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def options(self) -> dict:
        return {"master": f"{LOOPBACK}:{self.rpc_port}", "metadata": P2P_METADATA}

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = [self.rpc_port, self.metrics_port]
        while pending:
            if self.process.poll() is not None:
                raise BackendUnavailable(f"mooncake_master exited with code {self.process.returncode} at start"
                                         + (f" (log: {self.log})" if self.log else ""))
            if time.monotonic() > deadline:
                raise BackendUnavailable(f"mooncake_master did not listen on 127.0.0.1:{pending} within {timeout} s")
            try:
                socket.create_connection(("127.0.0.1", pending[0]), timeout=0.2).close()
                pending.pop(0)
            except OSError:
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._out is not subprocess.DEVNULL:
            self._out.close()

    def __enter__(self) -> "MooncakeServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
