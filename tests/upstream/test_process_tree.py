"""The harnesses stop every process a run started, torchrun's workers included: they sit in
sessions of their own, which killing torchrun's process group does not reach."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from process_tree import descendants, kill_tree

# A parent whose child starts a session of its own, as torchrun's workers do.
PARENT = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], "
          "start_new_session=True); time.sleep(60)")


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().rsplit(") ", 1)[1][0] != "Z"]


def _start() -> tuple[subprocess.Popen, list[int]]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], start_new_session=True)
    for _ in range(100):
        tree = descendants(parent.pid)
        if tree:
            return parent, tree
        time.sleep(0.05)
    raise AssertionError("the child never started")


def test_killing_the_group_alone_leaves_a_worker_in_its_own_session():
    parent, tree = _start()
    os.killpg(parent.pid, 9)
    parent.wait()
    time.sleep(0.2)
    left = _alive(tree)
    for pid in left:
        os.kill(pid, 9)
    assert left == tree  # what the harnesses did before kill_tree


def test_kill_tree_stops_every_process_below_the_launcher():
    parent, tree = _start()
    kill_tree(parent.pid)
    parent.wait()
    time.sleep(0.2)
    assert _alive(tree) == []
