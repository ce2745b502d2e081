"""NUMA-aware core binding: each local rank (and the data-loader workers it forks, which
inherit the mask) runs on cores of the NUMA node nearest its device, the node's cores split
evenly among the ranks that share it.  Without a device NUMA node (a CPU-only machine, or a
driver that does not report one) the allowed cores are split evenly by local rank.

The topology is read from sysfs (``/sys/devices/system/node/node*/cpulist``); a device's
node from its PCI device's ``/sys/bus/pci/devices/<bus id>/numa_node`` (the bus id of a CUDA
or Ascend device: :mod:`.device_bus`).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from .errors import TopologyError

log = logging.getLogger("mindspeed_flow")

SYSFS_NODES = Path("/sys/devices/system/node")
SYSFS_PCI = Path("/sys/bus/pci/devices")
_NODE_DIR = re.compile(r"node(\d+)")


def parse_cpulist(text: str, where: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]``."""
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise TopologyError(f"{where}: {part!r} is not a CPU number or range") from None
        if last < first:
            raise TopologyError(f"{where}: range {part!r} runs backwards")
        cpus.extend(range(first, last + 1))
    return cpus


def read_topology(root: Path = SYSFS_NODES) -> dict[int, list[int]]:
    """``{node: cpus}`` of nodes that have CPUs; empty when ``root`` does not exist."""
    topology = {}
    if not root.is_dir():
        return topology
    for entry in sorted(root.iterdir()):
        match = _NODE_DIR.fullmatch(entry.name)
        cpulist = entry / "cpulist"
        if match and cpulist.exists():
            cpus = parse_cpulist(cpulist.read_text(), str(cpulist))
            if cpus:
                topology[int(match.group(1))] = cpus
    return topology


def pci_numa_node(bus_id: str, root: Path = SYSFS_PCI) -> int | None:
    """The NUMA node sysfs reports for a PCI device (``None``: no such device, or ``-1``)."""
    path = root / bus_id.lower() / "numa_node"
    if not path.exists():
        return None
    text = path.read_text().strip()
    try:
        node = int(text)
    except ValueError:
        raise TopologyError(f"{path}: {text!r} is not a NUMA node number") from None
    return node if node >= 0 else None


def split_evenly(items: Sequence[int], parts: int, index: int) -> list[int]:
    """Part ``index`` of ``items`` cut into ``parts`` contiguous runs whose sizes differ by at
    most one; with fewer items than parts, ranks share: part ``index`` is one item."""
    if len(items) < parts:
        return [items[index % len(items)]]
    size, extra = divmod(len(items), parts)
    start = index * size + min(index, extra)
    return list(items[start:start + size + (1 if index < extra else 0)])


@dataclass(frozen=True)
class Binding:
    """The cores one local rank is bound to, and why."""

    local_rank: int
    cpus: tuple[int, ...]
    node: int | None
    reason: str

    def describe(self) -> str:
        where = f"NUMA node {self.node}" if self.node is not None else "no device NUMA node"
        return f"local rank {self.local_rank}: cores {format_cpus(self.cpus)} ({where}; {self.reason})"


def format_cpus(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def plan_binding(topology: Mapping[int, Sequence[int]], allowed: set[int], local_rank: int,
                 local_world_size: int, device_nodes: Sequence[int | None] | None = None) -> Binding:
    """The binding of ``local_rank``; ``device_nodes[r]`` is local rank r's device node.

    Only cores in ``allowed`` (this process's current mask) are ever used.
    """
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} outside local world size {local_world_size}")
    node = device_nodes[local_rank] if device_nodes else None
    if node is not None:
        node_cpus = [c for c in topology.get(node, ()) if c in allowed]
        if node_cpus:
            sharing = [r for r, n in enumerate(device_nodes) if n == node]
            cpus = split_evenly(node_cpus, len(sharing), sharing.index(local_rank))
            return Binding(local_rank, tuple(cpus), node,
                           f"{len(sharing)} rank(s) share the node's {len(node_cpus)} core(s)")
    every = sorted(c for cpus in topology.values() for c in cpus if c in allowed) or sorted(allowed)
    cpus = split_evenly(every, local_world_size, local_rank)
    nodes = [n for n, node_cpus in topology.items() if set(cpus) <= set(node_cpus)]
    return Binding(local_rank, tuple(cpus), nodes[0] if nodes else None,
                   f"even split of {len(every)} core(s) among {local_world_size} local rank(s)")


def local_ranks(environ: Mapping[str, str]) -> tuple[int, int]:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` as torchrun sets them (a single process: ``(0, 1)``)."""
    try:
        return int(environ.get("LOCAL_RANK", "0")), int(environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        raise ValueError(f"LOCAL_RANK={environ.get('LOCAL_RANK')!r} / LOCAL_WORLD_SIZE="
                         f"{environ.get('LOCAL_WORLD_SIZE')!r} are not integers") from None


def binding_for_this_process(environ: Mapping[str, str] | None = None, root: Path = SYSFS_NODES,
                             device_nodes: Sequence[int | None] | None = None) -> Binding:
    environ = os.environ if environ is None else environ
    rank, world = local_ranks(environ)
    return plan_binding(read_topology(root), set(os.sched_getaffinity(0)), rank, world, device_nodes)


def apply_binding(binding: Binding) -> None:
    os.sched_setaffinity(0, binding.cpus)
    log.info("mindspeed-flow system: bound %s", binding.describe())
