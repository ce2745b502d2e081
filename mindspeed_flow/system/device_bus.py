"""Each local rank's device PCI bus id, the key to its NUMA node in sysfs
(``/sys/bus/pci/devices/<bus id>/numa_node``, read by :func:`~.numa.pci_numa_node`).

Where the bus id comes from:

* **CUDA**: ``torch.cuda.get_device_properties(i)``'s ``pci_domain_id`` / ``pci_bus_id`` /
  ``pci_device_id`` (the same id ``nvidia-smi --query-gpu=pci.bus_id`` prints, there with an
  8-digit domain).  ``i`` is the local rank: torch's index already counts only the devices
  in ``CUDA_VISIBLE_DEVICES``.
* **Ascend**: the driver's ``npu-smi`` tool, as Ascend's own manual CPU-binding guide
  (MindIE) does it.  ``npu-smi info -m`` lists ``NPU ID  Chip ID  Chip Logic ID  Chip Name``
  (an MCU row has ``-`` as logic id); the chip whose logic id is the rank's device gives
  ``npu-smi info -t board -i <NPU ID> -c <Chip ID>``, whose ``PCIe Bus Info`` line is the bus
  id.  The rank's device is entry ``local rank`` of ``ASCEND_RT_VISIBLE_DEVICES`` when that
  is set, else the local rank itself.  ``torch_npu`` is not imported (the binding runs
  before it, so the Ascend environment defaults still come first).

A query that fails (no tool, a chip it does not list, an unreadable answer) gives ``None``
for that rank: the rank is then bound by the even split, and the log says so.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Callable, Mapping, Sequence

from .errors import BusIdError

# ``(argv) -> stdout``; the real one runs the tool, tests pass a named stand-in.
CommandRunner = Callable[[Sequence[str]], str]
# ``(local world size) -> each local rank's bus id (None: unknown)``.
BusIdQuery = Callable[[int], list[str | None]]

_BDF = re.compile(r"(?:([0-9a-fA-F]{4,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])")
_BOARD_BUS = re.compile(r"PCIe\s*Bus\s*Info\s*:\s*(\S+)", re.IGNORECASE)


def normalise_bus_id(text: str, where: str) -> str:
    """``"00000000:3B:00.0"`` / ``"3b:00.0"`` -> ``"0000:3b:00.0"`` (sysfs's spelling)."""
    match = _BDF.fullmatch(text.strip())
    if not match:
        raise BusIdError(f"{where}: {text.strip()!r} is not a PCI bus id (domain:bus:device.function)")
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{bus.lower()}:{device.lower()}.{function}"


def run_command(argv: Sequence[str]) -> str:
    """The tool's stdout (a failing or missing tool raises ``OSError`` / ``CalledProcessError``)."""
    return subprocess.run(list(argv), capture_output=True, text=True, check=True, timeout=30).stdout


def npu_chips(listing: str) -> dict[int, tuple[int, int]]:
    """``npu-smi info -m`` -> ``{chip logic id: (NPU ID, Chip ID)}`` (MCU rows have no logic id)."""
    chips = {}
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0].isdigit() and fields[1].isdigit() and fields[2].isdigit():
            chips[int(fields[2])] = (int(fields[0]), int(fields[1]))
    return chips


def npu_logic_ids(local_world_size: int, environ: Mapping[str, str]) -> list[int]:
    """Each local rank's chip logic id (``ASCEND_RT_VISIBLE_DEVICES`` maps rank -> device)."""
    visible = environ.get("ASCEND_RT_VISIBLE_DEVICES", "").strip()
    if not visible:
        return list(range(local_world_size))
    try:
        ids = [int(v) for v in visible.split(",")]
    except ValueError:
        raise BusIdError(f"ASCEND_RT_VISIBLE_DEVICES={visible!r} is not a comma-separated list of device ids") from None
    if len(ids) < local_world_size:
        raise BusIdError(f"ASCEND_RT_VISIBLE_DEVICES={visible!r} lists {len(ids)} device(s) "
                         f"for {local_world_size} local rank(s)")
    return ids[:local_world_size]


def npu_bus_ids(local_world_size: int, environ: Mapping[str, str],
                run: CommandRunner = run_command) -> list[str | None]:
    """Each local rank's NPU bus id from ``npu-smi`` (``None`` where it does not say)."""
    chips = npu_chips(run(["npu-smi", "info", "-m"]))
    bus_ids: list[str | None] = []
    for logic_id in npu_logic_ids(local_world_size, environ):
        if logic_id not in chips:
            bus_ids.append(None)
            continue
        npu, chip = chips[logic_id]
        board = run(["npu-smi", "info", "-t", "board", "-i", str(npu), "-c", str(chip)])
        match = _BOARD_BUS.search(board)
        where = f"npu-smi info -t board -i {npu} -c {chip}"
        bus_ids.append(normalise_bus_id(match.group(1), where) if match else None)
    return bus_ids


def cuda_bus_ids(local_world_size: int) -> list[str | None]:
    """Each local rank's CUDA device bus id from torch (``None`` past the visible devices)."""
    import torch

    bus_ids: list[str | None] = []
    for device in range(local_world_size):
        if device >= torch.cuda.device_count():
            bus_ids.append(None)
            continue
        props = torch.cuda.get_device_properties(device)
        bus_ids.append(f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0")
    return bus_ids


def npu_smi_available() -> bool:
    return shutil.which("npu-smi") is not None
