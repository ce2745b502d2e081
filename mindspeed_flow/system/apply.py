"""Applying the ``system`` feature when the plugin activates (before upstream, and so
``torch_npu``, is imported): the Ascend environment defaults, then the core binding.

The device NUMA nodes the binding follows come from each local rank's PCI bus id
(:mod:`.device_bus`: ``npu-smi`` on Ascend, ``torch.cuda`` on CUDA) and that PCI device's
``numa_node`` in sysfs.  A machine with neither gets the even split.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, MutableMapping

from .ascend_env import EnvSetting, apply_ascend_env
from .device_bus import BusIdQuery, CommandRunner, cuda_bus_ids, npu_bus_ids, npu_smi_available, run_command
from .numa import SYSFS_NODES, SYSFS_PCI, Binding, apply_binding, binding_for_this_process, local_ranks, pci_numa_node

log = logging.getLogger("mindspeed_flow")

_applied: tuple[list[EnvSetting], Binding] | None = None


@dataclass(frozen=True)
class DeviceAffinity:
    """Where each local rank's device sits: its bus id and that PCI device's NUMA node."""

    source: str
    bus_ids: list[str | None]
    nodes: list[int | None]

    def note(self, local_rank: int) -> str:
        bus = self.bus_ids[local_rank]
        if bus is None:
            return f"device bus id unknown to {self.source}"
        node = self.nodes[local_rank]
        return f"device {bus} from {self.source}, sysfs numa_node " + ("not reported" if node is None else str(node))


def device_kind() -> str | None:
    """``"npu"`` where torch_npu and the driver's npu-smi are installed, ``"cuda"`` where torch
    sees a CUDA device, else ``None``."""
    if importlib.util.find_spec("torch_npu") is not None and npu_smi_available():
        return "npu"
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return None
    import torch

    return "cuda" if torch.cuda.is_available() else None


def device_affinity(environ: Mapping[str, str], kind: str | None, pci_root: Path = SYSFS_PCI,
                    run: CommandRunner = run_command, cuda_query: BusIdQuery = cuda_bus_ids) -> DeviceAffinity | None:
    """Each local rank's device node (``None`` without a device, or when npu-smi fails)."""
    _, world = local_ranks(environ)
    if kind == "npu":
        source = "npu-smi"
        try:
            bus_ids = npu_bus_ids(world, environ, run)
        except (OSError, subprocess.SubprocessError) as error:
            log.warning("mindspeed-flow system: npu-smi did not answer (%s); binding by even split", error)
            return None
    elif kind == "cuda":
        source, bus_ids = "torch.cuda", cuda_query(world)
    else:
        return None
    return DeviceAffinity(source, bus_ids, [None if b is None else pci_numa_node(b, pci_root) for b in bus_ids])


def planned_binding(environ: Mapping[str, str], kind: str | None, node_root: Path = SYSFS_NODES,
                    pci_root: Path = SYSFS_PCI, run: CommandRunner = run_command,
                    cuda_query: BusIdQuery = cuda_bus_ids) -> Binding:
    """The binding of this process's local rank, its reason naming the device node's source."""
    affinity = device_affinity(environ, kind, pci_root, run, cuda_query)
    binding = binding_for_this_process(environ, node_root, None if affinity is None else affinity.nodes)
    if affinity is None:
        return binding
    return dataclasses.replace(binding, reason=f"{binding.reason}; {affinity.note(binding.local_rank)}")


def ascend_env_report(environ: MutableMapping[str, str]) -> list[EnvSetting]:
    if importlib.util.find_spec("torch_npu") is None:
        return []
    if "torch_npu" in sys.modules:
        log.warning("mindspeed-flow system: torch_npu was imported before the plugin activated; "
                    "the Ascend environment defaults may come too late for it")
    return apply_ascend_env(environ)


def applied_settings() -> tuple[list[EnvSetting], Binding] | None:
    """What :func:`apply_system_settings` did in this process (``None``: not called)."""
    return _applied


def apply_system_settings(environ: MutableMapping[str, str] | None = None) -> tuple[list[EnvSetting], Binding]:
    """Once per process: Ascend defaults (where torch_npu is installed) and the binding."""
    global _applied
    if _applied is None:
        environ = os.environ if environ is None else environ
        report = ascend_env_report(environ)
        for setting in report:
            log.info("mindspeed-flow system: %s", setting.describe())
        binding = planned_binding(environ, device_kind())
        apply_binding(binding)
        _applied = (report, binding)
    return _applied
