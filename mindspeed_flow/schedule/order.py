"""Per-rank compute order: each skeleton's own order, merged where layouts share a rank.

A sharded stage follows its skeleton's closed-form order; a replicated rank has two orders,
its microbatches' forwards and their backwards.  Where several orders meet on one rank (a
transposed ViT on the ranks of the LLM pipeline) they are merged by a list schedule over
nominal durations: every rank starts, among the next steps of its orders whose inputs are
done, the one that can start first (ties: the visit nearer the loss, which is on the
critical path).  Each order stays as its skeleton wrote it; only the interleaving is chosen.
A transposed region with ``order="prefix"`` or ``"phased"`` is not interleaved by
readiness: its rank's order is fixed as the public Mpipe code (prefix) or the three-phase
co-located step (phased) fixes it (:func:`_prefixed`).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Callable, NamedTuple, Sequence

from .actions import Action, Kind
from .errors import ScheduleError
from .placement import Group, Placement, Visit
from .skeletons import AHEAD, PHASED, SHARDED, replicated_orders

# Nominal seconds of one compute action at one visit.
Duration = Callable[[Action, Visit], float]
# A compute in the merge's dependency graph: ("F" or "B", microbatch, index on its path).
Node = tuple[str, int, int]

_BACKWARD_KINDS = {kind.value: kind for kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)}
_UNIT = {Kind.FORWARD: 1.0, Kind.BACKWARD: 2.0, Kind.BACKWARD_INPUT: 1.0, Kind.BACKWARD_WEIGHT: 1.0}


def unit_duration(action: Action, visit: Visit) -> float:
    """One unit per layer forward, two per layer backward, one for each half of a split one;
    a backward away from its forward recomputes that forward first (one more)."""
    recompute = action.kind is not Kind.FORWARD and visit.backward_rank is not None
    return (_UNIT[action.kind] + recompute) * visit.layers


class Streams(NamedTuple):
    """orders: per rank, the compute orders of the groups on it; waits: extra inputs of an
    action beyond its data (a replicated forward waiting for an earlier backward)."""

    orders: dict[int, list[list[Action]]]
    waits: dict[Action, Action]


def streams(placement: Placement, num_microbatches: int) -> Streams:
    """Per rank, the compute orders the skeletons prescribe for the groups running on it."""
    orders: dict[int, list[list[Action]]] = {r: [] for r in range(placement.num_ranks)}
    waits: dict[Action, Action] = {}
    prefixes: dict[int, tuple[list[list[Action]], list[list[Action]], Visit, bool]] = {}
    for group in placement.groups:
        n = len(group.ranks)
        sharded = group.layout == SHARDED
        feeder = None if sharded else _feeder(placement, group)
        for p, rank in enumerate(group.ranks):
            if sharded:
                steps = [group.skeleton.order(p, n, num_microbatches)]
                slices = [group.slices[group.skeleton.virtual_stage(c, p, n)]
                          for c in range(group.skeleton.chunks)]
            else:
                owned = list(range(p, num_microbatches, n))
                if group.recomputes:  # every backward on the rank of the stage it feeds
                    steps = replicated_orders(owned, list(range(num_microbatches)) if rank == feeder.rank else [])
                else:
                    steps = replicated_orders(owned)
                slices = [tuple((r.name, r.num_layers) for r in group.regions)]
            expanded = [
                [_expand(phase, m, slices[chunk], placement.backward,
                         group.skeleton.virtual_stage(chunk, p, n) if sharded else 0)
                 for phase, chunk, m in order]
                for order in steps
            ]
            if getattr(group.skeleton, "order", None) in AHEAD:
                prefixes[rank] = (*expanded, feeder, group.skeleton.order == PHASED)
                continue
            orders[rank] += [[a for step in order for a in step] for order in expanded]
            window = None if sharded else group.skeleton.max_in_flight
            has_backward = not sharded and any(step for step in expanded[1])
            if window and has_backward:
                forwards, backwards = expanded
                for k in range(window, len(forwards)):
                    waits[forwards[k][0]] = backwards[k - window][-1]
    for rank, (forwards, backwards, feeder, phased) in prefixes.items():
        orders[rank] = [_prefixed(forwards, orders[rank], backwards, feeder, phased)]
    return Streams(orders, waits)


def _feeder(placement: Placement, group: Group) -> Visit | None:
    """The visit right after a replicated group's regions: what its output feeds."""
    path = placement.path(0)
    names = {r.name for r in group.regions}
    after = 1 + max(k for k, v in enumerate(path) if v.region in names)
    return path[after] if after < len(path) else None


def _prefixed(
    forwards: list[list[Action]],
    host: list[list[Action]],
    backwards: list[list[Action]],
    feeder: Visit,
    phased: bool = False,
) -> list[Action]:
    """A transposed region's ``order="prefix"`` on one rank, as the public Mpipe code runs
    it: every forward of the region first, then the host pipeline's order unchanged, each
    backward of the region right after the feeder's backward that yields its gradient when
    that runs here (the first stage), the others at the end in microbatch order.
    ``phased`` (``order="phased"``): every backward of the region at the end, the first
    stage's too (the third phase of the co-located step)."""
    pending = {step[0].microbatch: step for step in backwards if step}
    combined = [a for step in forwards for a in step]
    for a in (a for order in host for a in order):
        combined.append(a)
        if not phased and a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT) and (a.region, a.stage) == (
                feeder.region, feeder.stage) and a.microbatch in pending:
            combined += pending.pop(a.microbatch)
    return combined + [a for m in sorted(pending) for a in pending[m]]


def _expand(
    phase: str,
    microbatch: int,
    slices: Sequence[tuple[str, int]],
    backward: dict[str, str | None],
    stage: int,
) -> list[Action]:
    """A step on a (virtual) stage becomes one action per region slice held there.  Step
    ``"B"`` runs each slice's first backward kind (``B`` or ``I``), step ``"W"`` (zero-bubble
    skeletons) the weight-gradient half of a split one."""
    if phase == "F":
        return [Action(Kind.FORWARD, name, stage, microbatch) for name, _ in slices]
    part = slice(0, 1) if phase == "B" else slice(1, None)
    return [
        Action(_BACKWARD_KINDS[letter], name, stage, microbatch)
        for name, _ in reversed(slices)
        for letter in (backward[name] or "")[part]
    ]


class Timed(NamedTuple):
    """A compute action in the nominal list schedule: when it ran and in which pick."""

    action: Action
    start: float
    end: float
    pick: int  # position in the global sequence of picks (non-decreasing start times)


def merge(
    plan_streams: Streams,
    paths: Sequence[Sequence[Visit]],
    duration: Duration = unit_duration,
) -> dict[int, list[Timed]]:
    """Interleave each rank's orders by a list schedule over nominal durations; returns
    every rank's compute order with its nominal times.

    Each pick takes, over all ranks, the ready next step with the least ``(start, -index on
    the path, rank, order)``.  Picked starts never decrease (a new candidate starts no
    earlier than the pick that made it ready), so one heap holds every ready step: a rank's
    steps are re-keyed when its clock moves, a blocked step waits on the one input it lacks
    and is re-keyed when that input is done.  That is O(actions x orders per rank x log)
    instead of a scan of every rank per pick, and it picks exactly what the scan picks.
    """
    rank_streams, waits = plan_streams
    index = {(m, v.region, v.stage): k for m, path in enumerate(paths) for k, v in enumerate(path)}
    has_backward = [[v.backward is not None for v in path] for path in paths]

    def node(action: Action) -> Node:
        phase = {Kind.FORWARD: "F", Kind.BACKWARD_WEIGHT: "W"}.get(action.kind, "B")
        return phase, action.microbatch, index[(action.microbatch, action.region, action.stage)]

    nodes = {rank: [[node(a) for a in stream] for stream in ss] for rank, ss in rank_streams.items()}
    extra = {node(a): node(b) for a, b in waits.items()}
    finish: dict[Node, float] = {}
    free = {rank: 0.0 for rank in rank_streams}
    heads = {rank: [0] * len(s) for rank, s in rank_streams.items()}
    order: dict[int, list[Timed]] = {rank: [] for rank in rank_streams}
    stamp = {rank: [0] * len(ss) for rank, ss in rank_streams.items()}  # latest keying of each order
    ready: list[tuple[float, int, int, int, int]] = []  # (start, -k, rank, order, stamp)
    blocked: dict[Node, list[tuple[int, int, int]]] = defaultdict(list)  # input -> (rank, order, stamp)
    total = sum(len(s) for ss in rank_streams.values() for s in ss)

    def inputs(step: Node) -> tuple[Node | None, ...]:
        """What a step waits for (``None``: nothing in that place)."""
        phase, m, k = step
        wait = extra.get(step)
        if phase == "F":
            return wait, ("F", m, k - 1) if k > 0 else None
        if phase == "W":  # the weight gradients follow the input gradients of the visit
            return ("B", m, k), wait
        after = ("B", m, k + 1) if k + 1 < len(has_backward[m]) and has_backward[m][k + 1] else None
        return ("F", m, k), after, wait

    needs = {rank: [[inputs(step) for step in stream] for stream in ss] for rank, ss in nodes.items()}

    def key(rank: int, s: int) -> None:
        """(Re)place the next step of order ``s`` on ``rank``: on the heap if its inputs are
        done, else under the first input it lacks."""
        head = heads[rank][s]
        if head == len(nodes[rank][s]):
            return
        stamps = stamp[rank]
        stamps[s] = current = stamps[s] + 1
        start = free[rank]
        for need in needs[rank][s][head]:
            if need is None:
                continue
            done = finish.get(need)
            if done is None:
                blocked[need].append((rank, s, current))
                return
            if done > start:
                start = done
        heapq.heappush(ready, (start, -nodes[rank][s][head][2], rank, s, current))

    for rank, ss in rank_streams.items():
        for s in range(len(ss)):
            key(rank, s)
    for pick in range(total):
        while ready and ready[0][4] != stamp[ready[0][2]][ready[0][3]]:
            heapq.heappop(ready)  # keyed again since
        if not ready:
            raise ScheduleError("skeleton orders cannot be merged: " + _stuck(rank_streams, heads))
        start, _, rank, s, _ = heapq.heappop(ready)
        action = rank_streams[rank][s][heads[rank][s]]
        done = nodes[rank][s][heads[rank][s]]
        _, m, k = done
        finish[done] = free[rank] = start + duration(action, paths[m][k])
        order[rank].append(Timed(action, start, free[rank], pick))
        heads[rank][s] += 1
        for other in range(len(nodes[rank])):
            key(rank, other)
        for waiter, t, was in blocked.pop(done, ()):
            if stamp[waiter][t] == was:
                key(waiter, t)
    return order


def _stuck(rank_streams: dict[int, list[list[Action]]], heads: dict[int, list[int]]) -> str:
    waiting = [
        f"rank {rank} waits at {stream[heads[rank][s]]}"
        for rank, ss in sorted(rank_streams.items())
        for s, stream in enumerate(ss)
        if heads[rank][s] < len(stream)
    ]
    return "; ".join(waiting)
