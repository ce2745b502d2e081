"""Issue 19, defect 5: a PP=2 job aborted at exit after its last iteration
("terminate called without an active exception", SIGABRT, torchrun rc 1).

The mechanism: a daemon thread that is inside a C++ ``work.wait()`` when the interpreter
finalizes is killed with ``pthread_exit`` once the wait returns and it asks for the GIL;
the forced unwind through C++ frames ends in ``std::terminate``.  The runtime's
:class:`~mindspeed_flow.runtime.transport.Waiter` threads are such daemon threads.  Here two
plain processes (gloo, no ``destroy_process_group``, as MindSpeed-MM's ``pretrain_vlm.py``
ends) leave a waiter inside a receive that completes only while the receiving process
exits: it must exit with 0, its waiter stopped at exit, and a waiter whose transfer never
completes is named in a warning instead of being left to abort the process silently.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import os, sys, time, torch
    import torch.distributed as dist
    from mindspeed_flow.runtime.transport import Waiter

    dist.init_process_group("gloo")
    rank, mode = dist.get_rank(), sys.argv[1]
    if rank == 1:
        waiter = Waiter("flow-test-recvs")
        buf = torch.empty(1 << 16)
        waiter.submit(dist.irecv(buf, src=0, tag=7), (buf,), lambda: "RECV test mb0")
        dist.barrier()
        print("rank 1 exiting with its waiter inside wait()", flush=True)
    else:
        dist.barrier()
        if mode == "late":
            time.sleep(0.5)  # the receive completes while rank 1 is exiting
            dist.send(torch.ones(1 << 16), dst=1, tag=7)
            time.sleep(1.0)
        else:
            time.sleep(8.0)  # "never": longer than rank 1's exit grace; then rank 0 exits
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(mode: str) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
        env.pop("MINDSPEED_FLOW_FLAGS", None)
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD, mode], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    done = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=120)
            done.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def test_waiter_inside_a_wait_at_exit_does_not_abort_the_process():
    for attempt in range(3):  # it aborted every time before the waiters were stopped at exit
        receiver = _run("late")[1]
        assert receiver.returncode == 0, (attempt, receiver.returncode, receiver.stdout)
        assert "terminate called" not in receiver.stdout


def test_waiter_whose_transfer_never_completes_is_named_at_exit():
    receiver = _run("never")[1]
    assert "waiter thread(s) are still inside a transfer that did not complete" in receiver.stdout, receiver.stdout
    assert "flow-test-recvs: RECV test mb0" in receiver.stdout
