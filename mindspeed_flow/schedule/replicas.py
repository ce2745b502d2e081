"""What replicated regions owe each step: their collectives and their in-flight window.

A replicated region (:class:`.Transpose`, :class:`.Decoupled`) runs whole copies of its
layers on several ranks, each copy for its own microbatches.  When it is trainable the copies
must start from the same parameters and end with the sum of their gradients: exactly one
parameter broadcast before the region's first forward and one gradient reduce after its last
backward on *every* member, each over the full replica group and only that group.  A frozen
region, a sharded region (one copy of each layer) and a region with a single replica have
neither.  A replicated skeleton with ``max_in_flight`` also promises that no member ever holds
more than that many microbatches' activations.  The validator trusts none of this to
:func:`.compose`: hand-edited and loaded programs are checked here, each fault named like the
point-to-point ones (rank, action index and text).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

from .actions import BACKWARDS, COLLECTIVES, Action, Kind
from .errors import ScheduleError
from .pairing import describe
from .placement import Group, Placement
from .plan import Plan
from .skeletons import SHARDED

_WHAT = {Kind.PARAM_BROADCAST: "parameter broadcast", Kind.GRAD_REDUCE: "gradient reduce"}


def check_replicas(plan: Plan) -> None:
    """Raise :class:`.ScheduleError` for the first collective or window fault of ``plan``."""
    groups = {region.name: group for group in Placement(plan.regions).groups for region in group.regions}
    trainable = {region.name: region.trainable for region in plan.regions}
    expected = {
        (kind, name): group.ranks
        for name, group in groups.items()
        if trainable[name] and group.layout != SHARDED and len(group.ranks) > 1
        for kind in _WHAT
        if not (kind is Kind.GRAD_REDUCE and group.recomputes)
    }
    calls = _check_each_collective(plan.programs, groups, trainable, expected)
    _check_every_member_once(plan.programs, expected, calls)
    for group in {id(g): g for g in groups.values()}.values():
        _check_window(plan, group)


def _check_each_collective(
    programs: Mapping[int, Sequence[Action]],
    groups: Mapping[str, Group],
    trainable: Mapping[str, bool],
    expected: Mapping[tuple[Kind, str], tuple[int, ...]],
) -> dict[tuple[Kind, str, int], list[int]]:
    """Every collective names a replicated trainable region and its full group, and sits
    on the right side of that region's computes; returns their indices per (kind, region, rank)."""
    calls: dict[tuple[Kind, str, int], list[int]] = defaultdict(list)
    for rank, program in programs.items():
        for i, a in enumerate(program):
            if a.kind not in COLLECTIVES:
                continue
            where = describe(programs, (rank, i))
            if a.region not in groups:
                raise ScheduleError(f"{where}: there is no region {a.region!r}")
            if (a.kind, a.region) not in expected:
                raise ScheduleError(f"{where}: {_why_none(a, groups[a.region], trainable[a.region])}")
            group = expected[(a.kind, a.region)]
            if a.group != group:
                raise ScheduleError(
                    f"{where}: group {list(a.group)} is not the replica group {list(group)} of "
                    f"region {a.region!r} (a {_WHAT[a.kind]} spans every replica and only them)"
                )
            if a.microbatch is not None or a.peer is not None or a.stage or a.key:
                raise ScheduleError(
                    f"{where}: a collective covers the whole replicated region once per step: "
                    "stage 0, no microbatch, peer or key"
                )
            _check_side(programs, rank, i, a)
            calls[(a.kind, a.region, rank)].append(i)
    return calls


def _why_none(a: Action, group: Group, trainable: bool) -> str:
    if group.layout == SHARDED:
        return (f"region {a.region!r} is sharded (one copy of each layer): no {_WHAT[a.kind]} "
                "across its pipeline stages")
    if not trainable:
        return f"region {a.region!r} is frozen: its replicas have no {_WHAT[a.kind]}"
    if group.recomputes:
        return (f"region {a.region!r} runs every backward on one rank (backward='recompute'): "
                f"no {_WHAT[a.kind]}")
    return f"region {a.region!r} has a single replica: there is nothing to {a.kind.value.lower()}"


def _check_side(programs: Mapping[int, Sequence[Action]], rank: int, i: int, a: Action) -> None:
    """A broadcast precedes every compute of its region on the rank, a reduce follows every
    backward (otherwise replicas start from different weights or drop later gradients)."""
    program = programs[rank]
    if a.kind is Kind.PARAM_BROADCAST:
        late = next((j for j in range(i) if program[j].kind is Kind.FORWARD
                     and program[j].region == a.region), None)
        if late is not None:
            raise ScheduleError(
                f"{describe(programs, (rank, i))}: the parameter broadcast comes after "
                f"{describe(programs, (rank, late))}; it must precede the region's first forward"
            )
    else:
        early = next((j for j in range(len(program) - 1, i, -1) if program[j].kind in BACKWARDS
                      and program[j].region == a.region), None)
        if early is not None:
            raise ScheduleError(
                f"{describe(programs, (rank, i))}: the gradient reduce comes before "
                f"{describe(programs, (rank, early))}; it must follow the region's last backward"
            )


def _check_every_member_once(
    programs: Mapping[int, Sequence[Action]],
    expected: Mapping[tuple[Kind, str], tuple[int, ...]],
    calls: Mapping[tuple[Kind, str, int], list[int]],
) -> None:
    for (kind, region), group in sorted(expected.items(), key=repr):
        for rank in group:
            found = calls.get((kind, region, rank), [])
            text = f"{kind.value} {region}.s0 group={list(group)}"
            if not found:
                side = "before its first forward" if kind is Kind.PARAM_BROADCAST else "after its last backward"
                raise ScheduleError(
                    f"rank {rank} has no {_WHAT[kind]} of trainable replicated region {region!r}: "
                    f"expected one `{text}` {side}"
                )
            if len(found) > 1:
                raise ScheduleError(
                    f"{describe(programs, (rank, found[1]))}: rank {rank} runs `{text}` "
                    f"{len(found)} times, expected once per step"
                )


def _check_window(plan: Plan, group: Group) -> None:
    """No member of a windowed replicated group holds more than ``max_in_flight``
    microbatches: from a microbatch's first forward there until its last backward there."""
    window = getattr(group.skeleton, "max_in_flight", None)
    regions = {region.name for region in group.regions}
    if group.layout == SHARDED or window is None:
        return
    backwards_per_microbatch = sum(
        len(visit.backward or "") for visit in plan.paths[0] if visit.region in regions
    ) if plan.paths else 0
    if not backwards_per_microbatch:
        return  # nothing is held for a backward pass that never comes
    for rank in group.ranks:
        held: dict[int, int] = {}  # microbatch -> backwards still to run
        for i, a in enumerate(plan.programs[rank]):
            if a.region not in regions or a.microbatch is None:
                continue
            if a.kind is Kind.FORWARD and a.microbatch not in held:
                held[a.microbatch] = backwards_per_microbatch
                if len(held) > window:
                    raise ScheduleError(
                        f"{describe(plan.programs, (rank, i))}: rank {rank} would hold "
                        f"{len(held)} microbatches in flight {sorted(held)}, more than "
                        f"max_in_flight={window} of {type(group.skeleton).__name__}"
                    )
            elif a.kind in BACKWARDS and a.microbatch in held:
                held[a.microbatch] -= 1
                if not held[a.microbatch]:
                    del held[a.microbatch]
