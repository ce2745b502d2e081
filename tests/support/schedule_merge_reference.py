"""The list schedule of :func:`mindspeed_flow.schedule.order.merge`, by its definition.

Before every pick it looks at the next step of every order on every rank, keeps those whose
inputs are done and takes the least ``(start, -index on the path, rank, order)``: O(ranks)
per pick, O(p^2 m) for a pipeline.  This is how compose merged orders until issue 13; the
tests hold the heap-based merge to it pick for pick, and ``scripts/bench_schedule_compose.py``
times it as the baseline.
"""

from __future__ import annotations

from typing import Sequence

from mindspeed_flow.schedule.actions import Kind
from mindspeed_flow.schedule.errors import ScheduleError
from mindspeed_flow.schedule.order import Duration, Streams, Timed, unit_duration
from mindspeed_flow.schedule.placement import Visit


def scan_merge(
    plan_streams: Streams,
    paths: Sequence[Sequence[Visit]],
    duration: Duration = unit_duration,
) -> dict[int, list[Timed]]:
    """Same arguments and result as ``order.merge``."""
    rank_streams, waits = plan_streams
    position = {(m, v.region, v.stage): k for m, path in enumerate(paths) for k, v in enumerate(path)}
    done: dict[tuple[str, int, int], float] = {}
    clock = {rank: 0.0 for rank in rank_streams}
    next_step = {rank: [0] * len(orders) for rank, orders in rank_streams.items()}
    timeline: dict[int, list[Timed]] = {rank: [] for rank in rank_streams}

    def step_of(action):
        pass_ = {Kind.FORWARD: "F", Kind.BACKWARD_WEIGHT: "W"}.get(action.kind, "B")
        return pass_, action.microbatch, position[(action.microbatch, action.region, action.stage)]

    def needs(action):
        pass_, m, k = step_of(action)
        window = [step_of(waits[action])] if action in waits else []
        if pass_ == "F":
            return window + ([("F", m, k - 1)] if k > 0 else [])
        if pass_ == "W":
            return [("B", m, k)] + window
        later = [("B", m, k + 1)] if k + 1 < len(paths[m]) and paths[m][k + 1].backward else []
        return [("F", m, k)] + later + window

    for pick in range(sum(len(o) for orders in rank_streams.values() for o in orders)):
        candidates = []
        for rank in sorted(rank_streams):
            for s, order in enumerate(rank_streams[rank]):
                if next_step[rank][s] < len(order):
                    action = order[next_step[rank][s]]
                    inputs = needs(action)
                    if all(n in done for n in inputs):
                        start = max([clock[rank]] + [done[n] for n in inputs])
                        candidates.append(((start, -step_of(action)[2], rank, s), action))
        if not candidates:
            raise ScheduleError("skeleton orders cannot be merged")
        (start, _, rank, s), action = min(candidates, key=lambda c: c[0])
        _, m, k = step_of(action)
        done[step_of(action)] = clock[rank] = start + duration(action, paths[m][k])
        timeline[rank].append(Timed(action, start, clock[rank], pick))
        next_step[rank][s] += 1
    return timeline
