"""The main job's ranks, launched by :mod:`mindspeed_flow.spawn` (spawned on this machine, or
one rank of a ``torchrun`` launch; devices, the store on loopback and failure reports are
that module's).

What the job adds: each rank runs under :func:`~mindspeed_flow.train.warnings_log.capture`
(upstream's warnings and output lines counted, merged into one :class:`Noise` for the
report; under torchrun rank 0 keeps the terminal for the progress bars), and a worker that
uses megatron-core gets megatron-core's CPU shims on a CPU rank.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

from mindspeed_flow.spawn import DistEnv, RankFailed, cuda_usable, make_env, run_ranks, under_torchrun
from mindspeed_flow.train.warnings_log import Capture, Noise, capture

__all__ = ["DistEnv", "RankFailed", "cuda_usable", "make_env", "run_world", "under_torchrun"]

Event = Callable[[Any], None]
Worker = Callable[..., Any]  # worker(env, emit, *args) -> picklable result


def run_world(worker: Worker, world_size: int, *args: Any, on_event: Optional[Event] = None,
              timeout_s: float = 1800.0, megatron: bool = True,
              after_stop: Optional[Callable[[list[int]], None]] = None) -> Optional[tuple[list[Any], Noise]]:
    """Run ``worker(env, emit, *args)`` on every rank (:func:`mindspeed_flow.spawn.run_ranks`).
    Returns the ranks' results (by rank) and their merged noise in the reporting process (the
    parent, or rank 0 under torchrun); None on the other torchrun ranks.  ``megatron=False``:
    a worker that never touches megatron-core (no CPU shims, so megatron is not imported)."""
    launched = run_ranks(_with_shims, world_size, worker, megatron, *args, on_event=on_event,
                         timeout_s=timeout_s, around=_counted, name="train-rank", after_stop=after_stop)
    if launched is None:
        return None
    noise = Noise()
    for rows in launched.reports:
        noise.merge(Noise.from_json(rows))
    return launched.results, noise


class _Counted:
    """What :func:`_counted` yields: the rank's noise as JSON once the capture has ended."""

    def __init__(self, captured: Capture) -> None:
        self.captured = captured

    def report(self) -> list[dict]:
        return self.captured.noise.to_json()


@contextlib.contextmanager
def _counted(env: DistEnv) -> Iterator[_Counted]:
    # rank 0 of a torchrun launch keeps the terminal for the progress bars; every other
    # rank's output is counted
    with capture(redirect_fds=not (under_torchrun() and env.rank == 0)) as captured:
        yield _Counted(captured)


def _with_shims(env: DistEnv, emit: Event, worker: Worker, megatron: bool, *args: Any) -> Any:
    shims = None
    if env.cpu and megatron:
        from mindspeed_flow.adapters.megatron.core import enable_cpu_shims

        shims = enable_cpu_shims()
    try:
        return worker(env, emit, *args)
    finally:
        if shims is not None:
            shims.remove()
