"""The job's pool clean-up (mindspeed_flow/pool/job.py): rank 0 removes what the job's
``shm`` pools left in ``/dev/shm`` at a normal exit, an exception (Ctrl-C) and SIGTERM
(torchrun's answer to a dying rank)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mindspeed_flow.pool.job import job_prefix
from mindspeed_flow.pool.shm import SHM_ROOT, destroy

_RANK0 = r'''
import sys, time, torch
from mindspeed_flow.pool import open_pool
from mindspeed_flow.pool.job import remove_at_exit
name, how = sys.argv[1], sys.argv[2]
pool = open_pool("shm", capacity_bytes=1 << 12, name=name + "-b0", owner="rank0")
pool.put("k", torch.arange(4))
remove_at_exit("shm", name)
from mindspeed_flow.pool.shm import SHM_ROOT
print("ready", len(list(SHM_ROOT.glob(f"*{name}*"))), flush=True)
if how == "raise":
    raise KeyboardInterrupt
if how == "sleep":
    time.sleep(60)
'''


def _left(name: str) -> list[str]:
    return sorted(p.name for p in SHM_ROOT.glob(f"*{name}*"))


@pytest.mark.parametrize("how", ["exit", "raise", "sigterm"])
def test_rank0_removes_the_jobs_pools_when_it_ends(how):
    name = f"{job_prefix(os.getpid())}{how}"
    try:
        proc = subprocess.Popen([sys.executable, "-c", _RANK0, name, "sleep" if how == "sigterm" else how],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready, opened = proc.stdout.readline().split()
        assert ready == "ready" and int(opened) > 0, "the pool was not opened"
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        if how == "sigterm":
            assert proc.returncode == -signal.SIGTERM
        deadline = time.time() + 5
        while _left(name) and time.time() < deadline:
            time.sleep(0.05)
        assert _left(name) == []
    finally:
        destroy(name)
