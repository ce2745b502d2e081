"""Stop a launched job with every process under it.

torchrun starts each worker in a session of its own (torch's ``SubprocessHandler`` passes
``start_new_session=True``), so killing torchrun's process group does not reach the workers,
and a worker whose agent was SIGKILLed is re-parented to init and waits on a store that is
gone.  The tree is read from ``/proc`` (parent pids) *before* anything is killed, while the
parent links still hold.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children first), read from ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we read
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every process below it, whatever its session."""
    tree = descendants(pid)
    for target in (lambda: os.killpg(pid, signal.SIGKILL), *(lambda p=p: os.kill(p, signal.SIGKILL) for p in tree)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass
