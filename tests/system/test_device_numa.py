"""The device NUMA node the core binding follows: the rank's PCI bus id (Ascend: from
``npu-smi``; CUDA: from ``torch.cuda``) and that PCI device's ``numa_node`` in sysfs.

There is no NPU and no GPU here: ``npu-smi`` is replaced by a stand-in function that answers
in the tool's documented layout (``STAND_IN_NPU_SMI``), the CUDA query by a stand-in list of
bus ids, and sysfs by a fake tree.  The binding itself is planned against this process's
real core mask (the fake topology is built from its cores).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from mindspeed_flow.doctor import binding_report
from mindspeed_flow.system.apply import planned_binding
from mindspeed_flow.system.device_bus import BusIdError, normalise_bus_id, npu_bus_ids, npu_chips
from mindspeed_flow.system.numa import TopologyError, pci_numa_node

CORES = sorted(os.sched_getaffinity(0))
needs_two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two allowed cores")

NPU_LISTING = """\
        NPU ID                         Chip ID                        Chip Logic ID                  Chip Name
        0                              0                              0                              Ascend 910B3
        0                              1                              -                              Mcu
        1                              0                              1                              Ascend 910B3
        1                              1                              -                              Mcu
"""
BOARD = """\
        NPU ID                         : {npu}
        Chip ID                        : 0
        Chip Type                      : Ascend
        Chip Name                      : 910B3
        PCIe Bus Info                  : {bus}
        Board ID                       : 0x65
"""
BUS = {0: "0000:C1:00.0", 1: "0000:01:00.0"}


class StandInNpuSmi:
    """Stands in for the driver's ``npu-smi`` (no NPU here); records every call."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv) -> str:
        self.calls.append(list(argv))
        if argv == ["npu-smi", "info", "-m"]:
            return NPU_LISTING
        npu = int(argv[argv.index("-i") + 1])
        return BOARD.format(npu=npu, bus=BUS[npu])


def fake_sysfs(root: Path, nodes: dict[int, int], pci: dict[str, str]) -> tuple[Path, Path]:
    """``nodes``: NUMA node -> one core; ``pci``: bus id -> its numa_node file's text."""
    for node, core in nodes.items():
        (root / "node" / f"node{node}").mkdir(parents=True)
        (root / "node" / f"node{node}" / "cpulist").write_text(f"{core}\n")
    for bus, text in pci.items():
        (root / "pci" / bus).mkdir(parents=True)
        (root / "pci" / bus / "numa_node").write_text(text + "\n")
    return root / "node", root / "pci"


def test_npu_bus_ids_follow_the_visible_devices():
    smi = StandInNpuSmi()
    assert npu_chips(NPU_LISTING) == {0: (0, 0), 1: (1, 0)}  # MCU rows have no logic id
    # rank 0 drives logic device 1, rank 1 device 0
    assert npu_bus_ids(2, {"ASCEND_RT_VISIBLE_DEVICES": "1,0"}, smi) == ["0000:01:00.0", "0000:c1:00.0"]
    assert smi.calls == [["npu-smi", "info", "-m"], ["npu-smi", "info", "-t", "board", "-i", "1", "-c", "0"],
                         ["npu-smi", "info", "-t", "board", "-i", "0", "-c", "0"]]
    # a device npu-smi does not list is unknown, not an error
    assert npu_bus_ids(3, {}, StandInNpuSmi()) == ["0000:c1:00.0", "0000:01:00.0", None]
    with pytest.raises(BusIdError, match="ASCEND_RT_VISIBLE_DEVICES='0' lists 1 device"):
        npu_bus_ids(2, {"ASCEND_RT_VISIBLE_DEVICES": "0"}, smi)
    with pytest.raises(BusIdError, match="ASCEND_RT_VISIBLE_DEVICES='a,b' is not a comma-separated"):
        npu_bus_ids(2, {"ASCEND_RT_VISIBLE_DEVICES": "a,b"}, smi)


def test_bus_id_spellings_and_bad_sysfs_values(tmp_path):
    assert normalise_bus_id("00000000:3B:00.0", "nvidia-smi") == "0000:3b:00.0"
    assert normalise_bus_id("c1:00.0", "x") == "0000:c1:00.0"
    with pytest.raises(BusIdError, match=r"npu-smi info -t board -i 0 -c 0: 'C1-00' is not a PCI bus id"):
        normalise_bus_id("C1-00", "npu-smi info -t board -i 0 -c 0")
    _, pci = fake_sysfs(tmp_path, {}, {"0000:c1:00.0": "one"})
    with pytest.raises(TopologyError, match=r"0000:c1:00.0/numa_node: 'one' is not a NUMA node number"):
        pci_numa_node("0000:c1:00.0", pci)


@needs_two_cores
def test_ascend_ranks_take_the_cores_of_their_npus_node(tmp_path):
    # NPU 0 sits on node 1, NPU 1 on node 0: the device order is the reverse of the even split
    nodes, pci = fake_sysfs(tmp_path, {0: CORES[0], 1: CORES[1]}, {"0000:c1:00.0": "1", "0000:01:00.0": "0"})
    got = [planned_binding({"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"}, "npu", nodes, pci, StandInNpuSmi())
           for r in range(2)]
    assert [(b.cpus, b.node) for b in got] == [((CORES[1],), 1), ((CORES[0],), 0)]
    assert "device 0000:c1:00.0 from npu-smi, sysfs numa_node 1" in got[0].describe()
    even = [planned_binding({"LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"}, None, nodes, pci) for r in range(2)]
    assert [b.cpus for b in even] == [(CORES[0],), (CORES[1],)]


@needs_two_cores
def test_npu_smi_that_fails_falls_back_to_the_even_split(tmp_path, caplog):
    nodes, pci = fake_sysfs(tmp_path, {0: CORES[0], 1: CORES[1]}, {})

    def missing_npu_smi(argv):
        raise FileNotFoundError("npu-smi")

    with caplog.at_level(logging.WARNING, logger="mindspeed_flow"):
        binding = planned_binding({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "npu", nodes, pci, missing_npu_smi)
    assert binding.cpus == (CORES[0],) and "even split" in binding.reason
    assert "npu-smi did not answer" in caplog.text


@needs_two_cores
def test_cuda_ranks_take_the_cores_of_their_gpus_node(tmp_path):
    def stand_in_cuda_bus_ids(world: int) -> list[str | None]:
        """Stands in for torch.cuda's device properties (no GPU here)."""
        return ["0000:3b:00.0", "0000:d8:00.0"][:world]

    nodes, pci = fake_sysfs(tmp_path, {0: CORES[0], 1: CORES[1]}, {"0000:3b:00.0": "1", "0000:d8:00.0": "-1"})
    environ = {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    first = planned_binding(environ, "cuda", nodes, pci, cuda_query=stand_in_cuda_bus_ids)
    assert (first.cpus, first.node) == ((CORES[1],), 1)
    # the second GPU's node is not reported (-1): that rank gets its even share
    second = planned_binding({**environ, "LOCAL_RANK": "1"}, "cuda", nodes, pci, cuda_query=stand_in_cuda_bus_ids)
    assert second.cpus == (CORES[1],) and "sysfs numa_node not reported" in second.reason


@needs_two_cores
def test_doctor_prints_the_device_binding(tmp_path):
    nodes, pci = fake_sysfs(tmp_path, {0: CORES[0], 1: CORES[1]}, {"0000:c1:00.0": "1", "0000:01:00.0": "0"})
    line = binding_report({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, kind="npu", node_root=nodes,
                          pci_root=pci, run=StandInNpuSmi())
    assert line == (f"core binding (--flow-system) it would apply: local rank 1: cores {CORES[0]} (NUMA node 0; "
                    "1 rank(s) share the node's 1 core(s); device 0000:01:00.0 from npu-smi, sysfs numa_node 0)")
