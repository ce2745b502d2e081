"""What an ``shm`` pool leaves in ``/dev/shm``: nothing after every participant closed;
after a whole process group is SIGKILLed, its files until ``mindspeed-flow pool-clean``
(which never touches a pool with a live participant); and no resource-tracker warning
about segments the pool already removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from mindspeed_flow.pool import open_pool
from mindspeed_flow.pool.shm import SHM_ROOT, clean, destroy


def _files(name: str) -> list[str]:
    return sorted(p.name for p in [*SHM_ROOT.glob(f"mindspeed_flow_pool-{name}"), *SHM_ROOT.glob(f"msf-{name}-*")])


def test_closing_every_participant_leaves_nothing():
    name = f"tidy{os.getpid()}"
    try:
        producer = open_pool("shm", capacity_bytes=1 << 12, name=name, owner="p0")
        consumer = open_pool("shm", capacity_bytes=1 << 12, name=name, owner="p1")
        consumer.get(producer.put("k", torch.arange(5)))
        producer.close()
        assert f"mindspeed_flow_pool-{name}" in _files(name)  # p1 still has the pool open
        assert f"msf-{name}-p0" not in _files(name)
        consumer.close()
        assert _files(name) == []
    finally:
        destroy(name)


_GROUP = r'''
import multiprocessing, sys, time, torch
from mindspeed_flow.pool import open_pool

def child(name):
    pool = open_pool("shm", capacity_bytes=1 << 12, name=name, owner="p1")
    pool.put("k", torch.ones(3))
    time.sleep(600)

if __name__ == "__main__":
    name = sys.argv[1]
    pool = open_pool("shm", capacity_bytes=1 << 12, name=name, owner="p0")
    proc = multiprocessing.get_context("spawn").Process(target=child, args=(name,))
    proc.start()
    pool.handle("k", timeout=120)
    print("ready", flush=True)
    time.sleep(600)
'''


def test_a_killed_process_group_is_cleaned_by_pool_clean_and_a_live_pool_is_not(tmp_path):
    name, live_name = f"killed{os.getpid()}", f"alive{os.getpid()}"
    script = tmp_path / "group.py"
    script.write_text(_GROUP)
    live = open_pool("shm", capacity_bytes=1 << 12, name=live_name, owner="p0")
    proc = subprocess.Popen([sys.executable, str(script), name], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 10  # the spawned child dies with its group
        while _files(name) and time.monotonic() < deadline and _alive_child(name):
            time.sleep(0.1)
        left = _files(name)
        assert left == sorted([f"mindspeed_flow_pool-{name}", f"msf-{name}-p0", f"msf-{name}-p1"]), left
        out = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "pool-clean", "--dry-run"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and f"would remove {SHM_ROOT / f'msf-{name}-p1'}" in out.stdout, out.stdout
        assert _files(name) == left
        out = subprocess.run([sys.executable, "-m", "mindspeed_flow.cli", "pool-clean", "--prefix", name],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "removed 3 path(s)" in out.stdout, out.stdout + out.stderr
        assert _files(name) == []
        assert clean(live_name) == [] and _files(live_name) == sorted([f"mindspeed_flow_pool-{live_name}",
                                                                       f"msf-{live_name}-p0"])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        live.close()
        destroy(name)
        destroy(live_name)
    assert _files(live_name) == []


def _alive_child(name: str) -> bool:
    """Whether a process still maps the killed pool's segments (the group is going down)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if f"msf-{name}-" in Path(f"/proc/{entry}/maps").read_text():
                    return True
            except OSError:
                continue
    return False


_FAILED_RANK = r'''
import multiprocessing, os, sys, torch
from mindspeed_flow.pool import open_pool
from mindspeed_flow.pool.shm import destroy

def rank(name):
    pool = open_pool("shm", capacity_bytes=1 << 12, name=name, owner="p1")
    pool.put("k", torch.ones(3))
    os._exit(1)  # a rank that fails without closing its pool

if __name__ == "__main__":
    name = sys.argv[1]
    pool = open_pool("shm", capacity_bytes=1 << 12, name=name, owner="p0")
    proc = multiprocessing.get_context("spawn").Process(target=rank, args=(name,))
    proc.start()
    proc.join()
    pool.close()
    destroy(name)  # what the train job does after its ranks stopped
    print("done", flush=True)
'''


def test_no_resource_tracker_warning_about_segments_already_removed(tmp_path):
    name = f"tracker{os.getpid()}"
    script = tmp_path / "failed.py"
    script.write_text(_FAILED_RANK)
    try:
        proc = subprocess.run([sys.executable, str(script), name], capture_output=True, text=True, timeout=120)
    finally:
        destroy(name)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    assert "resource_tracker" not in proc.stderr and "leaked shared_memory" not in proc.stderr, proc.stderr
