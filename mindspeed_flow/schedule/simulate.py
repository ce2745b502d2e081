"""simulate: discrete-event replay of a plan's programs with a cost model.

Every rank runs its program in order under the plan's blocking semantics (the ones the
validator proves deadlock-free): a compute takes its cost; a batch of transfers is posted
at once and ends when its last operation ends.  A transfer takes the link time of its bytes,
starting when the send is posted (eager: the sender goes on at once) or when both ends are
posted (rendezvous: the sender waits for the transfer too); each end of a point-to-point
transfer also spends the link's ``post`` of its own (after posting its send; after the
tensor arrived or it asked, whichever is later).  A pool put is local (the pool
holds the tensor) and the get pulls it; a collective starts when its last member arrives.
Event times follow from these rules alone, so the replay needs no global event queue:
ranks advance while the times their next step depends on are known.

:class:`SimResult` is plain data; :func:`.gantt.draw` charts one (this module does not
import the chart, which needs matplotlib and reads the result).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .actions import BACKWARDS, COLLECTIVES, COMPUTE, Action, Kind
from .costs import CostTable
from .errors import ScheduleError
from .execution import step_end
from .pairing import Ref, pair
from .plan import Plan


@dataclass(frozen=True)
class Interval:
    """One compute or collective as it ran: on ``rank`` from ``start`` to ``end`` seconds."""

    rank: int
    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class SimResult:
    """What one simulated step looked like.

    Attributes:
        plan: the plan replayed.
        intervals: computes and collectives, per rank in program order.
        step_time: time until the last rank finishes.
        busy: compute seconds per rank.
        peak_live: most microbatch visits whose activations a rank held at once.
        peak_bytes: the same in bytes (``RegionCost.stored_bytes`` shares).
    """

    plan: Plan
    intervals: tuple[Interval, ...]
    step_time: float
    busy: Mapping[int, float]
    peak_live: Mapping[int, int]
    peak_bytes: Mapping[int, float]

    @property
    def utilisation(self) -> dict[int, float]:
        """Per rank, the fraction of the step spent computing."""
        return {r: b / self.step_time if self.step_time else 0.0 for r, b in self.busy.items()}

    @property
    def bubble_fraction(self) -> float:
        """Idle share of all ranks' time over the step (waiting, transfers, bubbles)."""
        total = self.step_time * len(self.busy)
        return 1.0 - sum(self.busy.values()) / total if total else 0.0

    def summary(self) -> str:
        lines = [f"step {self.step_time:.3f}s, bubble {self.bubble_fraction:.1%}"]
        for rank in sorted(self.busy):
            lines.append(
                f"  r{rank} {self.plan.roles.get(rank, ''):<28} util {self.utilisation[rank]:6.1%}"
                f"  peak live {self.peak_live[rank]:3d} ({self.peak_bytes[rank] / 2**30:.2f} GiB)"
            )
        return "\n".join(lines)


def simulate(plan: Plan, costs: CostTable) -> SimResult:
    """Replay ``plan`` with ``costs``; raises :class:`.ScheduleError` if it cannot finish."""
    programs = plan.programs
    pairing = pair(programs)
    rendezvous = plan.semantics == "rendezvous"
    clock = {rank: 0.0 for rank in programs}
    pc = {rank: 0 for rank in programs}
    posted: dict[Ref, float] = {}
    intervals: dict[int, list[Interval]] = {rank: [] for rank in programs}
    live = {rank: [0, 0.0, 0, 0.0] for rank in programs}  # count, bytes, peak count, peak bytes

    def finish(ref: Ref) -> float | None:
        """When a posted transfer or collective completes, or None while it must wait."""
        action = programs[ref[0]][ref[1]]
        if action.kind is Kind.POOL_PUT:
            return posted[ref]
        if action.kind in COLLECTIVES:
            members = pairing.members[ref]
            if any(m not in posted for m in members):
                return None
            return max(posted[m] for m in members) + costs.transfer_seconds(action)
        sending = action.kind in (Kind.SEND_ACT, Kind.SEND_GRAD)
        post = costs.post_seconds(action)  # this rank's own part of a point-to-point transfer
        if sending and not rendezvous:
            return posted[ref] + post
        other = pairing.partner[ref]
        if other not in posted:
            return None
        receive = other if sending else ref
        together = rendezvous or action.kind is Kind.POOL_GET  # a pool get pulls when asked
        start = max(posted[ref], posted[other]) if together else posted[other]
        return max(posted[ref], start + costs.transfer_seconds(programs[receive[0]][receive[1]])) + post

    progress = True
    while progress:
        progress = False
        for rank, program in programs.items():
            while pc[rank] < len(program):
                end = step_end(program, pc[rank])
                action = program[pc[rank]]
                if action.kind in COMPUTE:
                    _compute(plan, costs, rank, action, clock, intervals, live)
                else:
                    ops = [(rank, j) for j in range(pc[rank], end)]
                    for op in ops:
                        posted.setdefault(op, clock[rank])
                    times = [finish(op) for op in ops]
                    if any(t is None for t in times):
                        break
                    done = max([clock[rank]] + times)
                    if action.kind in COLLECTIVES:
                        start = max(posted[m] for m in pairing.members[ops[0]])
                        intervals[rank].append(Interval(rank, start, done, action))
                    clock[rank] = done
                pc[rank] = end
                progress = True
    stuck = [rank for rank in programs if pc[rank] < len(programs[rank])]
    if stuck:
        raise ScheduleError(
            "simulation cannot finish (validate the plan first): " + ", ".join(
                f"rank {r} at #{pc[r]} `{programs[r][pc[r]]}`" for r in stuck
            )
        )
    busy = {
        rank: sum(i.end - i.start for i in ivs if i.action.kind in COMPUTE)
        for rank, ivs in intervals.items()
    }
    return SimResult(
        plan=plan,
        intervals=tuple(i for rank in sorted(intervals) for i in intervals[rank]),
        step_time=max(clock.values(), default=0.0),
        busy=busy,
        peak_live={rank: int(v[2]) for rank, v in live.items()},
        peak_bytes={rank: v[3] for rank, v in live.items()},
    )


def _compute(
    plan: Plan,
    costs: CostTable,
    rank: int,
    action: Action,
    clock: dict[int, float],
    intervals: dict[int, list[Interval]],
    live: dict[int, list],
) -> None:
    """Run one compute on ``rank``: advance its clock, record it, track held activations."""
    _, visit = plan.visits[(action.microbatch, action.region, action.stage)]
    start = clock[rank]
    clock[rank] = start + costs.compute_seconds(action, visit)
    intervals[rank].append(Interval(rank, start, clock[rank], action))
    if not visit.backward or visit.backward_rank is not None:
        return  # nothing is kept for a backward pass that never comes, or is recomputed elsewhere
    state = live[rank]
    if action.kind in BACKWARDS and action.kind.value != visit.backward[-1]:
        return  # the input-gradient half of a split backward: the weight half still needs them
    sign = -1 if action.kind in BACKWARDS else 1
    state[0] += sign
    state[1] += sign * costs.stored_bytes(visit)
    state[2] = max(state[2], state[0])
    state[3] = max(state[3], state[1])
