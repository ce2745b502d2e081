"""Processes joined in one process group: spawn ``world_size`` ranks on this machine, or be one
rank of a ``torchrun`` launch.  The one launcher of the project: the main job
(``mindspeed_flow.train.launch``), the self-test and the tests' CPU harness run their ranks here.

- Spawned (the default): this process holds a ``TCPStore`` listening on 127.0.0.1 only (torch
  binds a store's server to every interface whatever its host says, so the listening socket is
  bound here and handed over: :func:`mindspeed_flow.loopback.tcp_store_server`) on a port the
  OS picks, so concurrent launches cannot collide; it starts the ranks with torch's spawn
  context (no parent state leaks in), relays rank 0's events to a callback and collects the
  results by rank.  When a rank raises, dies or runs past the time limit, every rank is
  stopped and :class:`RankFailed` carries the traceback of the rank that failed first.
- Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set): this process is one rank; results
  are gathered to rank 0, which alone gets events and returns them.

Every rank passes a barrier right after joining: gloo can hand a rank its process group
before the peers have finished connecting to it, and a rank that then finished at once (a
worker with no collective) closed its sockets under a peer still in ``connectFullMesh``
("Connection closed by peer", seen once in CI).

Devices: with ``cuda`` and at least ``world_size`` CUDA GPUs (``LOCAL_RANK``'s under
torchrun) each rank uses ``cuda:local_rank`` with nccl; otherwise gloo on the CPU with one
torch thread per rank (the ranks share the cores; more threads only oversubscribe them).

A rank runs ``entry(env, emit, *args)`` (a module-level function: it is pickled by name).
``around(env)``, when given, is a context manager entered around the rank's whole session
(joining the group included); if what it yields has a ``report()`` method, its value after
the block comes back beside the rank's result.  Imports torch and the project's loopback
helpers only.
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, ContextManager, Optional

import torch

from mindspeed_flow.errors import RankFailed
from mindspeed_flow.loopback import LOOPBACK, tcp_store_server

EXIT_GRACE_S = 2.0  # ranks that are ending anyway (interrupted) clean up before being stopped
STOP_GRACE_S = 5.0
# After a first failure, how long to wait for the other ranks' reports. One rank's error makes
# its peers fail too ("connection closed by peer"); reports are ordered by the time they were
# raised, so the cause comes first whichever report arrives first.
FAILURE_GRACE_S = 3.0


@dataclass(frozen=True)
class DistEnv:
    """Where this rank runs."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # "gloo" | "nccl"
    cpu: bool


@dataclass
class Launched:
    """Every rank's result and ``around``'s report (``None`` without one), by rank."""

    results: list[Any]
    reports: list[Any] = field(default_factory=list)


Event = Callable[[Any], None]
Entry = Callable[..., Any]  # entry(env, emit, *args) -> picklable result
Around = Callable[[DistEnv], ContextManager[Any]]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cuda_usable(local_ranks: int) -> bool:
    """True when there is a CUDA GPU for each of ``local_ranks`` processes on this node."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks


def make_env(rank: int, world_size: int, local_rank: int, local_ranks: int, cuda: bool = True) -> DistEnv:
    if cuda and cuda_usable(local_ranks):
        return DistEnv(rank, world_size, local_rank, torch.device("cuda", local_rank), "nccl", cpu=False)
    return DistEnv(rank, world_size, local_rank, torch.device("cpu"), "gloo", cpu=True)


def run_ranks(entry: Entry, world_size: int, *args: Any, on_event: Optional[Event] = None,
              timeout_s: float = 1800.0, cuda: bool = True, around: Optional[Around] = None,
              name: str = "rank", after_stop: Optional[Callable[[list[int]], None]] = None) -> Optional[Launched]:
    """Run ``entry(env, emit, *args)`` on every rank; ``emit(event)`` on rank 0 reaches
    ``on_event`` in the reporting process (on the other ranks it does nothing).  Returns the
    ranks' results in the reporting process (this one, or rank 0 under torchrun), None on the
    other torchrun ranks.  ``cuda=False``: gloo on the CPU even where GPUs are.  ``name``:
    the spawned processes are ``{name}{rank}``.  ``after_stop(pids)``: called here with the
    ranks' pids once every spawned rank has ended, on success, failure or interrupt (to
    remove what killed ranks left behind)."""
    if under_torchrun():
        return _run_torchrun(entry, args, on_event, timeout_s, cuda, around)
    return _run_spawned(entry, world_size, args, on_event, timeout_s, cuda, around, name, after_stop)


# ---------------------------------------------------------------------- one rank


def _join(env: DistEnv, init: Callable[[timedelta], None], timeout_s: float) -> None:
    """Join the group with the per-rank settings, then the barrier of the module docstring."""
    import torch.distributed as dist

    if env.cpu:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets stay on loopback
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(env.device)
    init(timedelta(seconds=timeout_s))
    dist.barrier()


def _session(env: DistEnv, init: Callable[[timedelta], None], timeout_s: float, entry: Entry,
             emit: Event, args: tuple) -> Any:
    """Join, run the entry, leave the group; an exception carries ``raised_at``, the time it
    was raised, taken before the group is destroyed (destroying it makes the peers fail)."""
    import torch.distributed as dist

    try:
        _join(env, init, timeout_s)
        return entry(env, emit, *args)
    except BaseException as exc:
        exc.raised_at = time.time()  # type: ignore[attr-defined]
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report(box: Any) -> Any:
    return box.report() if hasattr(box, "report") else None


def _bootstrap(rank: int, world_size: int, port: int, timeout_s: float, entry: Entry, args: tuple,
               results: Any, cuda: bool, around: Optional[Around]) -> None:
    """Child side of a spawned launch: send back ("done", rank, result bytes, report) or
    ("error", rank, traceback, time raised).  The result is serialised with ``torch.save``,
    so its tensors do not depend on this process staying alive."""
    import torch.distributed as dist

    # spawned ranks share one machine: the group's own sockets (gloo pairs, NCCL's bootstrap)
    # listen on loopback too, not on the first network interface
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env = make_env(rank, world_size, rank, world_size, cuda)

    def init(timeout: timedelta) -> None:
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(env.backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                **({"device_id": env.device} if not env.cpu else {}))

    def emit(event: Any) -> None:
        if rank == 0:  # every rank runs the same steps; rank 0 speaks for them
            results.put(("event", rank, event, None))

    try:
        with (around(env) if around is not None else nullcontext()) as box:
            result = _session(env, init, timeout_s, entry, emit, args)
        buffer = io.BytesIO()
        torch.save(result, buffer)
        results.put(("done", rank, buffer.getvalue(), _report(box)))
    except BaseException as exc:  # noqa: BLE001 - the parent re-raises it with the rank named
        results.put(("error", rank, traceback.format_exc(), getattr(exc, "raised_at", time.time())))


# ---------------------------------------------------------------------- spawned


def _run_spawned(entry: Entry, world_size: int, args: tuple, on_event: Optional[Event], timeout_s: float,
                 cuda: bool, around: Optional[Around], name: str,
                 after_stop: Optional[Callable[[list[int]], None]]) -> Launched:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tcp_store_server(world_size, host=LOOPBACK, timeout=timedelta(seconds=timeout_s))  # 127.0.0.1 only
    procs = [ctx.Process(target=_bootstrap, name=f"{name}{rank}", daemon=True,
                         args=(rank, world_size, store.port, timeout_s, entry, args, results, cuda, around))
             for rank in range(world_size)]
    try:
        for proc in procs:
            proc.start()
        return _collect(procs, results, on_event, timeout_s)
    finally:
        _stop(procs)
        results.close()
        if after_stop is not None:
            after_stop([proc.pid for proc in procs if proc.pid is not None])


def _collect(procs: list, results: Any, on_event: Optional[Event], timeout_s: float) -> Launched:
    done: dict[int, tuple[Any, Any]] = {}
    failures: dict[int, tuple[float, str]] = {}
    settle_by = time.monotonic() + timeout_s
    while len(done) + len(failures) < len(procs) and time.monotonic() < settle_by:
        try:
            kind, rank, payload, extra = results.get(timeout=0.2)
        except queue.Empty:
            failures.update(_dead_without_report(procs, done.keys() | failures.keys()))
        else:
            if kind == "event":
                if on_event is not None and not failures:
                    on_event(payload)
            elif kind == "done":
                done[rank] = (torch.load(io.BytesIO(payload), weights_only=False), extra)
            else:
                failures[rank] = (extra, payload)
        if failures:
            settle_by = min(settle_by, time.monotonic() + FAILURE_GRACE_S)
    silent = sorted(set(range(len(procs))) - done.keys() - failures.keys())
    if failures or silent:
        raise RankFailed(_describe_failures(failures, silent, timeout_s))
    ordered = [done[rank] for rank in range(len(procs))]
    return Launched([result for result, _ in ordered], [report for _, report in ordered])


def _dead_without_report(procs: list, reported: set[int]) -> dict[int, tuple[float, str]]:
    """Ranks whose process ended abnormally (killed, crashed in C++) without a report."""
    return {rank: (time.time(), f"died with exit code {proc.exitcode} without a traceback (killed: out of memory?)")
            for rank, proc in enumerate(procs) if rank not in reported and proc.exitcode not in (None, 0)}


def _describe_failures(failures: dict[int, tuple[float, str]], silent: list[int], timeout_s: float) -> str:
    """The first failure's traceback in full, then the last line of each later one."""
    ordered = sorted(failures.items(), key=lambda item: item[1][0])
    lines = []
    if ordered:
        rank, (_, text) = ordered[0]
        lines.append(f"rank {rank} failed first; every rank was stopped:\n{text.rstrip()}")
        then = "".join(f"\n  then rank {r}: {_last_line(t)}" for r, (_, t) in ordered[1:])
        if then:
            lines.append(f"(the other failing ranks, in order:{then})")
    if silent:
        why = "stopped after the first failure" if failures else f"timed out after {timeout_s:.0f} s"
        lines.append(f"no result from ranks {silent} ({why})")
    return "\n".join(lines)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no traceback)"


def _stop(procs: list) -> None:
    procs = [proc for proc in procs if proc.pid is not None]  # started ones
    end = time.monotonic() + EXIT_GRACE_S
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    end = time.monotonic() + STOP_GRACE_S
    for proc in procs:
        proc.join(max(0.0, end - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


# ---------------------------------------------------------------------- torchrun


def _run_torchrun(entry: Entry, args: tuple, on_event: Optional[Event], timeout_s: float, cuda: bool,
                  around: Optional[Around]) -> Optional[Launched]:
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    env = make_env(rank, world_size, local_rank, local_ranks, cuda)

    def init(timeout: timedelta) -> None:
        dist.init_process_group(env.backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=timeout)

    def emit(event: Any) -> None:
        if rank == 0 and on_event is not None:
            on_event(event)

    # the reports are read when ``around`` ends, so the results are gathered after it
    try:
        with (around(env) if around is not None else nullcontext()) as box:
            _join(env, init, timeout_s)
            result = entry(env, emit, *args)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (result, _report(box)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank != 0:
        return None
    return Launched([r for r, _ in gathered], [report for _, report in gathered])


# ---------------------------------------------------------------------- gloo ranks by number


def run_cpu_ranks(worker: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0,
                  name: str = "rank") -> list[Any]:
    """Run ``worker(rank, world_size, *args)`` (module-level) in ``world_size`` freshly spawned
    processes joined in one gloo group on 127.0.0.1, even under torchrun or where GPUs are;
    returns their results by rank (every process stopped first), or raises
    :class:`RankFailed`."""
    return _run_spawned(_by_number, world_size, (worker, *args), None, timeout_s, False, None, name, None).results


def _by_number(env: DistEnv, emit: Event, worker: Callable[..., Any], *args: Any) -> Any:
    return worker(env.rank, env.world_size, *args)
