"""Servers on 127.0.0.1 only, and what a process really listens on.

``torch.distributed.TCPStore(host, port, is_master=True)`` binds its server socket to
*every* interface whatever ``host`` says (``ss -ltn`` shows ``*:PORT``): any machine that
reaches the port can read and write the job's keys.  :func:`tcp_store_server` binds the
listening socket itself, to ``host`` (127.0.0.1 by default), and hands it to the store
through the documented ``master_listen_fd`` argument (torch >= 2.1; libuv and the classic
backend both accept it), so the kernel's socket table shows ``127.0.0.1:PORT``.

:func:`listening_sockets` reads the kernel's table (``/proc/net/tcp``, ``/proc/net/tcp6``)
and maps each listening socket to the processes holding it (``/proc/<pid>/fd``), so a test
or ``mindspeed-flow doctor`` can check that nothing listens beyond loopback.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterable

LOOPBACK = "127.0.0.1"
_TCP_LISTEN = "0A"  # the state column of /proc/net/tcp*


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1, or an IPv4-mapped loopback (``::ffff:127.0.0.1``)."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return host == "localhost"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def listen_socket(host: str = LOOPBACK, port: int = 0, backlog: int = 2048) -> socket.socket:
    """A TCP socket bound to ``host:port`` (``port`` 0: the OS picks) and listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def tcp_store_server(world_size: int | None, *, host: str = LOOPBACK, port: int = 0,
                     timeout: timedelta = timedelta(seconds=300), wait_for_workers: bool = False,
                     **options: Any):
    """The server side of a ``TCPStore`` listening on ``host`` only (``.port`` is its port).

    Clients connect as usual: ``TCPStore(host, store.port, world_size, is_master=False)``."""
    import torch.distributed as dist

    sock = listen_socket(host, port)
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store's server owns (and closes) the descriptor from here on
    try:
        return dist.TCPStore(host, bound, world_size, is_master=True, timeout=timeout,
                             wait_for_workers=wait_for_workers, master_listen_fd=fd, **options)
    except BaseException:
        os.close(fd)
        raise


# ------------------------------------------------------------------ torch's own stores

# Where torch 2.13 creates a rendezvous store's server, by module: the name each module calls
# (bound there by ``from torch.distributed import TCPStore``).  ``env://`` / ``tcp://`` in
# ``init_process_group`` (rank 0, or every rank's client under torchrun), torchrun's static
# rendezvous (its agent's store), the c10d rendezvous backend (``--rdzv-backend c10d``,
# ``--standalone``).  ``DynamicRendezvousHandler._create_tcp_store_server`` (the store the
# c10d rendezvous shares with its workers) calls ``dist.TCPStore``: its method is wrapped.
STORE_NAMES = (
    ("torch.distributed.rendezvous", "TCPStore"),
    ("torch.distributed.elastic.rendezvous.static_tcp_rendezvous", "TCPStore"),
    ("torch.distributed.elastic.rendezvous.c10d_rendezvous_backend", "TCPStore"),
)
DYNAMIC_HANDLER = ("torch.distributed.elastic.rendezvous.dynamic_rendezvous", "DynamicRendezvousHandler",
                   "_create_tcp_store_server")
_STORE_PARAMS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers",
                 "multi_tenant", "master_listen_fd", "use_libuv")  # TCPStore.__init__, torch 2.13


def _bind_host(host: str) -> str:
    return LOOPBACK if host.strip("[]").lower() == "localhost" else host.strip("[]")


def _loopback_gloo() -> None:
    """A rendezvous on a loopback host means every rank is on this machine: gloo's sockets
    go on loopback too (``GLOO_SOCKET_IFNAME=lo`` unless the user set it; without it gloo
    listens on whatever the machine's hostname resolves to)."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return
    if "lo" in names:
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"


def loopback_store_factory(tcp_store, *, gloo: bool = False):
    """A callable used like ``tcp_store`` (torch's ``TCPStore``): a master store whose host
    is a loopback address (127.0.0.0/8, ``::1``, ``localhost``) and that was given no
    ``master_listen_fd`` gets a socket bound to that address, handed over as
    ``master_listen_fd`` (the chosen port, or the one the OS picks for port 0); every other
    argument goes to torch as given.  Anything else (a client, a non-loopback host, a
    port this process cannot bind, e.g. a multi-tenant store already serving it) is torch's
    own call, unchanged.  ``gloo``: a loopback host also sets ``GLOO_SOCKET_IFNAME=lo``."""
    import inspect

    unset = object()
    params = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                **({} if i < 2 else {"default": unset}))
              for i, name in enumerate(_STORE_PARAMS)]
    signature = inspect.Signature(params)

    def TCPStore(*args, **kwargs):  # noqa: N802  (it stands for torch's class)
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return tcp_store(*args, **kwargs)  # torch says what is wrong with the call
        given = bound.arguments
        host = given["host_name"]
        if not isinstance(host, str) or not is_loopback(host.strip("[]")):
            return tcp_store(*args, **kwargs)
        if gloo:
            _loopback_gloo()
        if not given.get("is_master", False) or given.get("master_listen_fd") not in (unset, None):
            return tcp_store(*args, **kwargs)
        try:
            sock = listen_socket(_bind_host(host), int(given["port"]))
        except (OSError, OverflowError, TypeError, ValueError):
            return tcp_store(*args, **kwargs)  # in use (a multi-tenant server?), bad port: torch decides
        port = sock.getsockname()[1]
        fd = sock.detach()  # the store's server owns it from here on
        args, kwargs = list(args), dict(kwargs)  # the call as given, with the port and the socket
        for name, value in (("port", port), ("master_listen_fd", fd)):
            position = _STORE_PARAMS.index(name)
            if len(args) > position:
                args[position] = value
            else:
                kwargs[name] = value
        try:
            return tcp_store(*args, **kwargs)
        except TypeError:  # torch refused the arguments: it never took the socket
            os.close(fd)
            raise

    TCPStore.__wrapped__ = tcp_store
    TCPStore.__doc__ = f"mindspeed-flow: torch's TCPStore, its master bound to a loopback host.\n\n{tcp_store.__doc__}"
    TCPStore._mindspeed_flow_loopback = True
    return TCPStore


class StoresOnLoopback:
    """What :func:`keep_stores_on_loopback` installed; :meth:`remove` puts torch's names back."""

    def __init__(self) -> None:
        self.active = False
        self.replaced: dict[tuple[str, str], tuple[Any, Any]] = {}  # (module, name) -> (owner, torch's)

    def _rebind(self, owner, name: str, key: tuple[str, str], make) -> None:
        if not self.active or key in self.replaced:
            return
        original = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if original is None or getattr(original, "_mindspeed_flow_loopback", False):
            return
        self.replaced[key] = (owner, original)
        setattr(owner, name, make(original))

    def _on_rendezvous_module(self, module) -> None:
        for module_name, name in STORE_NAMES:
            if module.__name__ == module_name:
                gloo = module_name == "torch.distributed.rendezvous"  # env:// and tcp:// (the ranks)
                self._rebind(module, name, (module_name, name),
                             lambda original: loopback_store_factory(original, gloo=gloo))

    def _on_dynamic_module(self, module) -> None:
        _, cls_name, method = DYNAMIC_HANDLER
        cls = getattr(module, cls_name, None)
        if cls is None:
            return

        def make(original):
            def _create_tcp_store_server(handler, master_addr, master_port):
                if not isinstance(master_addr, str) or not is_loopback(master_addr.strip("[]")):
                    return original(handler, master_addr, master_port)
                import torch.distributed as dist
                # torch 2.13's body, with the server bound to the loopback host
                return loopback_store_factory(dist.TCPStore)(host_name=master_addr, port=master_port,
                                                             is_master=True, multi_tenant=True)

            _create_tcp_store_server.__wrapped__ = original
            _create_tcp_store_server._mindspeed_flow_loopback = True
            return _create_tcp_store_server

        self._rebind(cls, method, (f"{module.__name__}.{cls_name}", method), make)

    def install(self) -> "StoresOnLoopback":
        if self.active:
            return self
        import sys

        import wrapt

        self.active = True
        for module_name, _ in STORE_NAMES:
            wrapt.register_post_import_hook(self._on_rendezvous_module, module_name)
        wrapt.register_post_import_hook(self._on_dynamic_module, DYNAMIC_HANDLER[0])
        for module_name in [name for name, _ in STORE_NAMES] + [DYNAMIC_HANDLER[0]]:
            if module_name in sys.modules:  # wrapt runs hooks of imported modules at once; be sure
                (self._on_dynamic_module if module_name == DYNAMIC_HANDLER[0]
                 else self._on_rendezvous_module)(sys.modules[module_name])
        return self

    def remove(self) -> None:
        """Put torch's own names back (hooks of modules not imported yet become no-ops)."""
        self.active = False
        for (_, name), (owner, original) in self.replaced.items():
            setattr(owner, name, original)
        self.replaced.clear()


_STORES = StoresOnLoopback()


def keep_stores_on_loopback() -> StoresOnLoopback:
    """Make torch's own rendezvous stores listen on their host alone when it is a loopback
    address: ``init_process_group`` with ``env://`` / ``tcp://`` (rank 0's store), torchrun's
    agent store (static and c10d rendezvous).  torch binds those on every interface whatever
    the host says.  Each place's ``TCPStore`` name is rebound (when its module is imported) to
    :func:`loopback_store_factory`; non-loopback hosts (multi-node jobs) are torch's own call.
    A loopback ``env://`` / ``tcp://`` rendezvous also keeps gloo on loopback
    (``GLOO_SOCKET_IFNAME=lo`` unless set).  Idempotent; ``.remove()`` undoes it."""
    return _STORES.install()


@dataclass(frozen=True)
class Listener:
    """One listening TCP socket: its local address and the pids that hold it."""

    host: str
    port: int
    pids: tuple[int, ...]

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port} (pid {', '.join(map(str, self.pids))})"


def _decode_address(hex_address: str) -> tuple[str, int]:
    host_hex, port_hex = hex_address.split(":")
    raw = bytes.fromhex(host_hex)
    if len(raw) == 4:
        host = str(ipaddress.IPv4Address(raw[::-1]))
    else:  # four little-endian 32-bit words
        words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        host = str(ipaddress.IPv6Address(words))
    return host, int(port_hex, 16)


def _listening_inodes() -> dict[int, tuple[str, int]]:
    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _TCP_LISTEN:
                inodes[int(fields[9])] = _decode_address(fields[1])
    return inodes


def _socket_inodes(pid: int) -> set[int]:
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (by parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        current = todo.pop()
        out.append(current)
        todo.extend(children.get(current, []))
    return out


def listening_sockets(pids: Iterable[int]) -> list[Listener]:
    """Every listening TCP socket (IPv4 and IPv6) held by one of ``pids``, from the
    kernel's table; the same socket held by several processes is listed once."""
    table = _listening_inodes()
    held: dict[int, list[int]] = {}
    for pid in pids:
        for inode in _socket_inodes(pid) & table.keys():
            held.setdefault(inode, []).append(pid)
    return sorted((Listener(*table[inode], tuple(sorted(owners))) for inode, owners in held.items()),
                  key=lambda item: (item.port, item.host))


def beyond_loopback(pids: Iterable[int]) -> list[Listener]:
    """The listening sockets of ``pids`` that accept connections from other machines."""
    return [item for item in listening_sockets(pids) if not item.loopback]


__all__ = ["LOOPBACK", "Listener", "StoresOnLoopback", "beyond_loopback", "descendants", "is_loopback",
           "keep_stores_on_loopback", "listen_socket", "listening_sockets", "loopback_store_factory",
           "tcp_store_server"]
