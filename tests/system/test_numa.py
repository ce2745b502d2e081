"""NUMA core binding on a fake sysfs tree (this machine has one node), the real
``sched_setaffinity`` in a child process, and the Ascend environment defaults."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_flow.system.ascend_env import ASCEND_DEFAULTS, apply_ascend_env
from mindspeed_flow.system.numa import (
    TopologyError, format_cpus, parse_cpulist, pci_numa_node, plan_binding, read_topology,
)


def fake_sysfs(root: Path, nodes: dict[int, str]) -> Path:
    for node, cpulist in nodes.items():
        (root / f"node{node}").mkdir(parents=True)
        (root / f"node{node}" / "cpulist").write_text(cpulist + "\n")
    (root / "possible").write_text("0-1\n")  # files that are not nodes are ignored
    return root


def test_topology_from_sysfs(tmp_path):
    root = fake_sysfs(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15", 2: ""})
    assert read_topology(root) == {0: [0, 1, 2, 3, 8, 9, 10, 11], 1: [4, 5, 6, 7, 12, 13, 14, 15]}
    assert read_topology(tmp_path / "absent") == {}
    bad = fake_sysfs(tmp_path / "bad", {0: "0-3,x"})
    with pytest.raises(TopologyError, match=r"node0/cpulist: 'x' is not a CPU number"):
        read_topology(bad)


def test_ranks_split_the_cores_of_their_devices_node(tmp_path):
    topo = read_topology(fake_sysfs(tmp_path, {0: "0-7", 1: "8-15"}))
    allowed = set(range(16))
    nodes = [0, 0, 1, 1]
    got = [plan_binding(topo, allowed, r, 4, nodes) for r in range(4)]
    assert [b.cpus for b in got] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert [b.node for b in got] == nodes
    # three ranks on node 1: 8 cores split 3/3/2; rank 0 alone on node 0 gets all of it
    got = [plan_binding(topo, allowed, r, 4, [0, 1, 1, 1]) for r in range(4)]
    assert [b.cpus for b in got] == [tuple(range(8)), (8, 9, 10), (11, 12, 13), (14, 15)]


def test_cpu_only_even_split_within_the_allowed_mask(tmp_path):
    topo = read_topology(fake_sysfs(tmp_path, {0: "0-3", 1: "4-7"}))
    got = [plan_binding(topo, {1, 2, 3, 4, 5, 6, 7}, r, 3) for r in range(3)]
    assert [b.cpus for b in got] == [(1, 2, 3), (4, 5), (6, 7)]
    assert [b.node for b in got] == [0, 1, 1]
    assert "even split of 7 core(s) among 3 local rank(s)" in got[0].describe()
    # more ranks than cores: ranks share, none is left without a core
    assert [plan_binding(topo, {0, 1}, r, 3).cpus for r in range(3)] == [(0,), (1,), (0,)]
    with pytest.raises(ValueError, match="local rank 3 outside local world size 3"):
        plan_binding(topo, {0}, 3, 3)


def test_cpulist_round_trip_and_pci_node(tmp_path):
    assert parse_cpulist("0-2,5,7-8", "x") == [0, 1, 2, 5, 7, 8]
    assert format_cpus([8, 7, 5, 0, 1, 2]) == "0-2,5,7-8"
    dev = tmp_path / "0000:3b:00.0"
    dev.mkdir()
    (dev / "numa_node").write_text("1\n")
    assert pci_numa_node("0000:3B:00.0", tmp_path) == 1
    (dev / "numa_node").write_text("-1\n")
    assert pci_numa_node("0000:3b:00.0", tmp_path) is None


BIND = r"""
import os, sys, json
from pathlib import Path
from mindspeed_flow.system.numa import binding_for_this_process, apply_binding
b = binding_for_this_process(root=Path(sys.argv[1]))
apply_binding(b)
print(json.dumps({"cpus": sorted(os.sched_getaffinity(0)), "planned": list(b.cpus)}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two allowed cores")
def test_applied_binding_is_the_process_mask(tmp_path):
    import json
    cores = sorted(os.sched_getaffinity(0))[:2]
    root = fake_sysfs(tmp_path, {0: f"{cores[0]}", 1: f"{cores[1]}"})
    masks = []
    for rank in range(2):
        env = dict(os.environ, LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
        out = subprocess.run([sys.executable, "-c", BIND, str(root)], env=env, check=True,
                             capture_output=True, text=True)
        masks.append(json.loads(out.stdout)["cpus"])
    assert masks == [[cores[0]], [cores[1]]]


def test_ascend_defaults_never_override_the_user():
    env = {"TASK_QUEUE_ENABLE": "1"}
    report = {s.name: s for s in apply_ascend_env(env)}
    assert env["TASK_QUEUE_ENABLE"] == "1" and not report["TASK_QUEUE_ENABLE"].applied
    assert env["PYTORCH_NPU_ALLOC_CONF"] == "expandable_segments:True"
    assert report["PYTORCH_NPU_ALLOC_CONF"].applied
    assert set(report) == {name for name, _, _ in ASCEND_DEFAULTS}
    assert report["TASK_QUEUE_ENABLE"].describe() == "TASK_QUEUE_ENABLE=1 (kept user value)"


def test_defaults_the_plugin_set_in_the_launcher_are_not_reported_as_the_users():
    """(issue 19, defect 6) torchrun's own process activates the plugin too (the flags are on
    its command line): its workers find the defaults set and say who set them."""
    launcher = {"TASK_QUEUE_ENABLE": "1"}
    apply_ascend_env(launcher)
    worker = {s.name: s for s in apply_ascend_env(dict(launcher))}
    assert worker["PYTORCH_NPU_ALLOC_CONF"].describe() == (
        "PYTORCH_NPU_ALLOC_CONF=expandable_segments:True (set by the plugin in the launching process)")
    assert worker["TASK_QUEUE_ENABLE"].describe() == "TASK_QUEUE_ENABLE=1 (kept user value)"


ORDER = r"""
import json, os, sys
from mindspeed_flow.patches import activate
activate(sys.argv[1:])
import torch_npu
print(json.dumps({"seen_at_import": torch_npu.SEEN, "mask": sorted(os.sched_getaffinity(0))}))
"""


def test_activation_sets_ascend_env_before_torch_npu_import(tmp_path):
    """``torch_npu`` here is a stand-in package (no NPU on this machine) that records the
    environment at import time."""
    fake = tmp_path / "torch_npu"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import os\nSEEN = {k: os.environ.get(k) for k in ('TASK_QUEUE_ENABLE', 'PYTORCH_NPU_ALLOC_CONF')}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("TASK_QUEUE_ENABLE", "PYTORCH_NPU_ALLOC_CONF")}
    env.update(PYTHONPATH=f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}", TASK_QUEUE_ENABLE="1",
               LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    import json
    run = subprocess.run([sys.executable, "-c", ORDER, "--flow-system"], env=env, check=True,
                         capture_output=True, text=True)
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["seen_at_import"] == {"TASK_QUEUE_ENABLE": "1", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
    allowed = sorted(os.sched_getaffinity(0))
    assert out["mask"] == allowed[len(allowed) // 2:] or (len(allowed) == 1 and out["mask"] == allowed)
    off = subprocess.run([sys.executable, "-c", ORDER], env=env, check=True, capture_output=True, text=True)
    assert json.loads(off.stdout.splitlines()[-1])["seen_at_import"]["PYTORCH_NPU_ALLOC_CONF"] is None


def test_doctor_prints_the_binding(capsys):
    from mindspeed_flow.cli import main
    main(["doctor", "--feature", "recipes"])
    out = capsys.readouterr().out
    assert f"core binding (--flow-system) it would apply: local rank 0: cores " \
           f"{format_cpus(sorted(os.sched_getaffinity(0)))}" in out
