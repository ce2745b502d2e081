"""Processes for the job: spawn ``world_size`` ranks on this machine, or be one rank of a
``torchrun`` launch.

- Spawned (the default): the parent holds a ``TCPStore`` listening on 127.0.0.1 only (torch
  binds a store's server to every interface whatever its host says, so the listening socket is
  bound here and handed over: :func:`mindspeed_flow.loopback.tcp_store_server`) on a port the OS
  picks, starts the ranks with ``torch.multiprocessing``'s spawn context, relays their
  events (progress) to a callback, and collects their results.  When a rank fails, every
  rank is stopped and :class:`RankFailed` carries the first failing rank's traceback.
- Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set): this process is one rank; results
  are gathered to rank 0, which alone gets events and returns the results.

Devices: with at least ``world_size`` CUDA GPUs (``LOCAL_RANK``'s under torchrun) each rank
uses ``cuda:local_rank`` with nccl and the CPU shims are never applied; otherwise gloo on
the CPU, megatron-core's CPU shims, and one torch thread per rank (the ranks share the
cores; more threads only oversubscribe them).
"""

from __future__ import annotations

import io
import os
import queue
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from mindspeed_flow.loopback import LOOPBACK, tcp_store_server
from mindspeed_flow.train.warnings_log import Noise, capture

EXIT_GRACE_S = 2.0
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class DistEnv:
    """Where this rank runs."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str  # "gloo" | "nccl"
    cpu: bool


class RankFailed(RuntimeError):
    """A rank raised, died or ran past the time limit; the message holds its traceback."""


Event = Callable[[Any], None]
Worker = Callable[..., Any]  # worker(env, emit, *args) -> picklable result


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def cuda_usable(local_ranks: int) -> bool:
    """True when there is a CUDA GPU for each of ``local_ranks`` processes on this node."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= local_ranks


def make_env(rank: int, world_size: int, local_rank: int, local_ranks: int) -> DistEnv:
    if cuda_usable(local_ranks):
        return DistEnv(rank, world_size, local_rank, torch.device("cuda", local_rank), "nccl", cpu=False)
    return DistEnv(rank, world_size, local_rank, torch.device("cpu"), "gloo", cpu=True)


def run_world(worker: Worker, world_size: int, *args: Any, on_event: Optional[Event] = None,
              timeout_s: float = 1800.0, megatron: bool = True,
              after_stop: Optional[Callable[[list[int]], None]] = None) -> Optional[tuple[list[Any], Noise]]:
    """Run ``worker(env, emit, *args)`` on every rank; ``emit(event)`` on rank 0 reaches
    ``on_event`` in the reporting process (on the other ranks it does nothing).  Returns
    the ranks' results (by rank) and their merged noise in the reporting process (the
    parent, or rank 0 under torchrun); None on the other torchrun ranks.
    ``megatron=False``: a worker that never touches megatron-core (no CPU shims, so
    megatron is not imported).  ``after_stop(pids)``: called in the parent with the
    ranks' pids once every spawned rank has ended, on success, failure or
    interrupt (to remove what killed ranks left behind)."""
    if under_torchrun():
        return _run_torchrun(worker, args, on_event, timeout_s, megatron)
    return _run_spawned(worker, world_size, args, on_event, timeout_s, megatron, after_stop)


# ---------------------------------------------------------------------- one rank


def _rank_session(env: DistEnv, init: Callable[[timedelta], None], timeout_s: float, megatron: bool):
    """Join the group and apply the per-rank settings; returns the undo."""
    import torch.distributed as dist

    if env.cpu:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's sockets stay on loopback
        torch.set_num_threads(1)
    else:
        torch.cuda.set_device(env.device)
    init(timedelta(seconds=timeout_s))
    # Gloo can hand a rank its process group before the peers have finished connecting to
    # it; a rank that then finished at once (a worker with no collective) closed its sockets
    # under a peer still in connectFullMesh ("Connection closed by peer", seen once in CI).
    dist.barrier()
    shims = None
    if env.cpu and megatron:
        from mindspeed_flow.adapters.megatron.core import enable_cpu_shims

        shims = enable_cpu_shims()

    def close() -> None:
        if shims is not None:
            shims.remove()
        if dist.is_initialized():
            dist.destroy_process_group()

    return close


def _bootstrap(rank: int, world_size: int, port: int, timeout_s: float, worker: Worker, args: tuple,
               results: Any, megatron: bool) -> None:
    """Child side of a spawned launch: run the worker under noise capture, send back
    ("done", rank, result bytes, noise) or ("error", rank, traceback, time)."""
    import torch.distributed as dist

    # spawned ranks share one machine: the group's own sockets (gloo pairs, NCCL's bootstrap)
    # listen on loopback too, not on the first network interface
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env = make_env(rank, world_size, rank, world_size)

    def init(timeout: timedelta) -> None:
        store = dist.TCPStore(LOOPBACK, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(env.backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                **({"device_id": env.device} if not env.cpu else {}))

    def emit(event: Any) -> None:
        if rank == 0:  # every rank runs the same steps; rank 0 speaks for them
            results.put(("event", rank, event, None))

    noise = Noise()
    try:
        with capture() as captured:
            close = _rank_session(env, init, timeout_s, megatron)
            try:
                result = worker(env, emit, *args)
            finally:
                close()
        noise = captured.noise
        buffer = io.BytesIO()
        torch.save(result, buffer)
        results.put(("done", rank, buffer.getvalue(), noise.to_json()))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank named
        results.put(("error", rank, traceback.format_exc(), time.time()))


def _run_spawned(worker: Worker, world_size: int, args: tuple, on_event: Optional[Event],
                 timeout_s: float, megatron: bool,
                 after_stop: Optional[Callable[[list[int]], None]]) -> tuple[list[Any], Noise]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = tcp_store_server(world_size, host=LOOPBACK, timeout=timedelta(seconds=timeout_s))  # 127.0.0.1 only
    procs = [ctx.Process(target=_bootstrap, name=f"train-rank{rank}", daemon=True,
                         args=(rank, world_size, store.port, timeout_s, worker, args, results, megatron))
             for rank in range(world_size)]
    try:
        for proc in procs:
            proc.start()
        return _collect(procs, results, on_event, time.monotonic() + timeout_s)
    finally:
        _stop(procs)
        results.close()
        if after_stop is not None:
            after_stop([proc.pid for proc in procs if proc.pid is not None])


def _collect(procs: list, results: Any, on_event: Optional[Event], deadline: float) -> tuple[list[Any], Noise]:
    done: dict[int, Any] = {}
    noise = Noise()
    errors: list[tuple[float, int, str]] = []
    while len(done) < len(procs):
        try:
            kind, rank, payload, extra = results.get(timeout=0.2)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if r not in done and not p.is_alive()]
            if dead:
                time.sleep(0.5)  # its message may still be in flight
                if results.empty():
                    rank, code = dead[0]
                    raise RankFailed(f"rank {rank} died with exit code {code} without a traceback "
                                     "(killed: out of memory?)")
                continue
            if time.monotonic() > deadline:
                raise RankFailed(f"ranks {sorted(set(range(len(procs))) - set(done))} still running after the "
                                 "time limit; all stopped")
            continue
        if kind == "event":
            if on_event is not None and not errors:
                on_event(payload)
        elif kind == "done":
            done[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            noise.merge(Noise.from_json(extra))
        else:
            errors.append((extra, rank, payload))
            _drain_errors(results, errors, grace_s=1.0)  # the others are failing too, or stuck in a collective
            break
    if errors:
        errors.sort()
        _, rank, tb = errors[0]
        then = "".join(f"\n  then rank {r}: {_last_line(t)}" for _, r, t in errors[1:])
        raise RankFailed(f"rank {rank} failed first; every rank was stopped:\n{tb}"
                         + (f"(the other failing ranks, in order:{then})" if then else ""))
    return [done[r] for r in range(len(procs))], noise


def _last_line(tb: str) -> str:
    lines = [line for line in tb.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no traceback)"


def _drain_errors(results: Any, errors: list, grace_s: float) -> None:
    """Other ranks fail right after the first (their peer is gone): wait briefly so the
    first one, by the time it raised, is the one reported."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        try:
            kind, rank, payload, extra = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if kind == "error":
            errors.append((extra, rank, payload))


def _stop(procs: list) -> None:
    procs = [proc for proc in procs if proc.pid is not None]  # started ones
    end = time.monotonic() + EXIT_GRACE_S  # ranks that are ending anyway (interrupted) clean up first
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


def _run_torchrun(worker: Worker, args: tuple, on_event: Optional[Event],
                  timeout_s: float, megatron: bool) -> Optional[tuple[list[Any], Noise]]:
    import torch.distributed as dist

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    env = make_env(rank, world_size, local_rank, local_ranks)

    def init(timeout: timedelta) -> None:
        dist.init_process_group(env.backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=timeout)

    def emit(event: Any) -> None:
        if rank == 0 and on_event is not None:
            on_event(event)

    # rank 0 keeps the terminal for the progress bars; the others' output is counted (its
    # lines are read when the capture ends, so the results are gathered after it)
    close = None
    try:
        with capture(redirect_fds=rank != 0) as captured:
            close = _rank_session(env, init, timeout_s, megatron)
            result = worker(env, emit, *args)
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (result, captured.noise.to_json()))
    finally:
        if close is not None:
            close()
    if rank != 0:
        return None
    noise = Noise()
    for _, rows in gathered:
        noise.merge(Noise.from_json(rows))
    return [r for r, _ in gathered], noise
