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


__all__ = ["LOOPBACK", "Listener", "beyond_loopback", "descendants", "is_loopback", "listen_socket",
           "listening_sockets", "tcp_store_server"]
