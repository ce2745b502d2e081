"""The pool a job asked for: ``--flow-pool-backend NAME`` (or ``--flow-pool``, which takes
the default backend) on Megatron's command line or in ``MINDSPEED_FLOW_FLAGS``, as the config
tree holds it (``pool.backend``); and the pool of one slice of a decoupled layout in a real
(Megatron) job: its name, who opens it, and its clean-up."""

from __future__ import annotations

import argparse
import atexit
import itertools
import os
from typing import Any, Mapping

from ..activation import flow_config
from ..config import FlowConfig
from .base import Pool

_instances = itertools.count()


def open_job_pool(args: argparse.Namespace, capacity_bytes: int, environ: Mapping[str, str] | None = None,
                  **options: Any) -> Pool:
    """Open the backend the job's config tree selects (``environ`` given: the tree resolved
    from ``args`` over that environment instead); refuse when the pool feature is off."""
    from . import open_pool

    config = flow_config(args) if environ is None else FlowConfig.from_namespace(args, environ)
    if config.pool_backend is None:
        raise ValueError("the job did not ask for a pool: pass --flow-pool-backend NAME (or --flow-pool)")
    return open_pool(config.pool_backend, capacity_bytes=capacity_bytes, **options)


def job_prefix(rank0_pid: int) -> str:
    """What every pool name of a Megatron job whose rank 0 has this pid starts with (the
    launcher and :func:`remove_job_pools` remove what such pools left in ``/dev/shm``)."""
    return f"mjob{rank0_pid}x"


def job_pool_name() -> str:
    """A name no other job on this host uses: rank 0's pid and a per-process counter,
    broadcast to every rank (collective over the world)."""
    import torch.distributed as dist

    token = [f"{job_prefix(os.getpid())}{next(_instances)}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return str(token[0])


def open_slice_pool(backend: str, layout: Any, groups: dict, name: str, capacity_bytes: int,
                    **options: Any) -> Any:
    """This rank's view of its slice's pool under a ``DecoupledLayout`` (``None`` on ranks
    whose programs have no pool transfer: backbone stages after the first): ``<name>-b<slice>``,
    or ``<name>-b`` for every slice when the layout ``deals_over_slices`` (a sample encoded in
    one slice may be trained in another).  The TP leaders of the slice's encoder replicas and
    first backbone stage open it; their TP peers see it through
    :class:`~.tensor_parallel.TensorParallelPool`.  Collective over the world."""
    import torch.distributed as dist

    from . import open_pool
    from .tensor_parallel import TensorParallelPool

    rank = dist.get_rank()
    replica = layout.replica(rank)
    leaders = layout.pool_ranks(replica)
    tp_ranks = layout.tp_group_ranks(rank)
    leader = tp_ranks[0]
    if leader not in leaders:
        return None
    pool = None
    if rank == leader:
        slice_name = f"{name}-b" if layout.deals_over_slices else f"{name}-b{replica}"
        extra = {"name": slice_name, "group": groups["pool"]} if backend == "torch" else \
            {"name": slice_name, "owner": f"rank{rank}"}
        pool = open_pool(backend, capacity_bytes=capacity_bytes, **extra, **options)
    if len(tp_ranks) == 1:
        return pool
    return TensorParallelPool(pool, groups["tp"], leader)


def remove_job_pools(backend: str, name: str) -> None:
    """What pools named ``name*`` left in ``/dev/shm`` (the ``shm`` backend; other backends
    hold nothing outside their processes)."""
    if backend != "shm":
        return
    from .shm import destroy

    destroy(name)


def remove_at_exit(backend: str, name: str) -> None:
    """Remove the job's pools when this process ends (rank 0 and every rank that opened
    one, so that the survivors of a dying rank remove them): normal exit and an exception
    that ends the job, Ctrl-C included (``atexit``), and SIGTERM, which torchrun sends every
    rank when one of them died (the handler removes them, then ends the process as SIGTERM
    would).  A SIGKILLed rank 0 leaves them to a sweep of :func:`job_prefix`."""
    import signal

    atexit.register(remove_job_pools, backend, name)
    before = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, frame: Any) -> None:
        remove_job_pools(backend, name)
        if callable(before):
            before(signum, frame)
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread: atexit only
        pass
