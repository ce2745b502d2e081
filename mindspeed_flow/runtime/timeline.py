"""Measured per-action timestamps, and the measured step as a :class:`.SimResult`.

The runtime records when every action of a rank's program started and ended; joined over
ranks, the record is drawn by the simulator's own Gantt code and its bubble fraction is
computed the same way, so a measured step and a simulated one compare directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..schedule.actions import COLLECTIVES, COMPUTE, Action
from ..schedule.plan import Plan
from ..schedule.simulate import Interval, SimResult


@dataclass(frozen=True)
class Stamp:
    """One action as it ran: index in the program, monotonic-clock start and end (s)."""

    index: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """One rank's stamps of one step (``time.monotonic``, shared by processes of a host)."""

    rank: int
    stamps: list[Stamp] = field(default_factory=list)

    def seconds_by_kind(self) -> dict[tuple[str, str], list[float]]:
        """(region, kind letter) -> measured durations of that rank's computes."""
        out: dict[tuple[str, str], list[float]] = {}
        for s in self.stamps:
            if s.action.kind in COMPUTE:
                out.setdefault((s.action.region, s.action.kind.value), []).append(s.end - s.start)
        return out


def measured_result(plan: Plan, timelines: Iterable[Timeline]) -> SimResult:
    """The measured step in the simulator's terms: computes and collectives as intervals
    from the earliest stamp of any rank, step time to the latest end, busy = compute time."""
    timelines = list(timelines)
    stamps: Sequence[tuple[int, Stamp]] = [(t.rank, s) for t in timelines for s in t.stamps]
    if not stamps:
        raise ValueError("no stamps: run a step with the runtime first")
    origin = min(s.start for _, s in stamps)
    intervals = tuple(
        Interval(rank, s.start - origin, s.end - origin, s.action)
        for rank, s in stamps
        if s.action.kind in COMPUTE or s.action.kind in COLLECTIVES
    )
    busy = {t.rank: sum(s.end - s.start for s in t.stamps if s.action.kind in COMPUTE) for t in timelines}
    step = max(s.end for _, s in stamps) - origin
    zero = {t.rank: 0 for t in timelines}
    return SimResult(plan, intervals, step, busy, zero, {r: 0.0 for r in zero})
