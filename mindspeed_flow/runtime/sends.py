"""How many send buffers a plan keeps alive: the runtime's bound, derived from the plan.

The validator replays programs under *eager* semantics: a send never waits.  The runtime
keeps a sent tensor's buffer until the transfer completes, and completes sends in posting
order (one waiter thread per rank), so at any moment a rank holds the span of sends from its
oldest incomplete one to its newest.  A bound ``K`` on that span makes send ``n`` wait until
sends ``0..n-K`` completed, i.e. until their receives were posted (gloo completes a send once
the receive is posted) - progress of *other* ranks that the validator never asked for.

This module replays what the executor really does, one primitive transfer at a time (a
``BCAST`` / ``REDUCE`` expands into the point-to-point messages the executor sends, a batch
of transfers runs in program order, not posted at once):

- :func:`plan_send_bound`: the largest span any rank can reach in *any* interleaving of the
  ranks (each rank at a send, every other rank as far behind as that send's dependencies
  allow).  With it as the bound no send ever waits for another rank: the plan runs exactly as
  the validator executed it, and its in-flight limits (``max_in_flight``) bound the buffers
  through the plan's own dependencies.  It is the runtime's default.
- :func:`deadlock_with_bound`: the replay with a given bound (``None``: unbounded), so an
  explicit, smaller bound is refused if it can deadlock the plan, and a plan whose batch
  order the executor cannot run in sequence is refused before anything runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

from ..schedule.actions import BACKWARDS, COMPUTE, Action, Kind
from ..schedule.errors import ScheduleError
from ..schedule.plan import Plan
from .errors import where

SKIPPED_WHEN_FORWARD_ONLY = BACKWARDS | {Kind.SEND_GRAD, Kind.RECV_GRAD, Kind.GRAD_REDUCE}

SEND, RECV, PUT, COMPUTE_OP = "send", "recv", "put", "compute"


@dataclass(frozen=True)
class Op:
    """One primitive step of a rank: a compute, a send or receive on ``channel`` (one
    message each way), or a pool put.  ``index`` is the action it belongs to."""

    what: str
    channel: Hashable
    index: int


def primitive_ops(plan: Plan, rank: int, forward_only: bool = False) -> list[Op]:
    """Rank ``rank``'s program as the executor runs it, message by message."""
    ops: list[Op] = []
    for i, a in enumerate(plan.programs[rank]):
        if forward_only and a.kind in SKIPPED_WHEN_FORWARD_ONLY:
            continue
        if a.kind in COMPUTE:
            ops.append(Op(COMPUTE_OP, None, i))
        elif a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
            ops.append(Op(SEND, (rank, a.peer, a.key, a.microbatch), i))
        elif a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
            ops.append(Op(RECV, (a.peer, rank, a.key, a.microbatch), i))
        elif a.kind is Kind.POOL_PUT:
            ops.append(Op(PUT, ("pool", a.key, a.microbatch), i))
        elif a.kind is Kind.POOL_GET:
            ops.append(Op(RECV, ("pool", a.key, a.microbatch), i))
        else:
            ops += _collective(a, rank, i)
    return ops


def _collective(a: Action, rank: int, i: int) -> list[Op]:
    """The messages of ``Executor``'s broadcast (root to each member) and reduce (each
    member to the root, then the sum back), in the order the executor posts them."""
    root, members = a.group[0], a.group[1:]
    name = (a.kind.value, a.region)
    if a.kind is Kind.PARAM_BROADCAST:
        if rank == root:
            return [Op(SEND, (root, m, name), i) for m in members]
        return [Op(RECV, (root, rank, name), i)]
    back = (a.kind.value + "-back", a.region)
    if rank == root:
        return [Op(RECV, (m, root, name), i) for m in members] + [Op(SEND, (root, m, back), i) for m in members]
    return [Op(SEND, (rank, root, name), i), Op(RECV, (root, rank, back), i)]


def deadlock_with_bound(plan: Plan, bound: int | None, forward_only: bool = False) -> str | None:
    """Replay the executor with at most ``bound`` sends alive per rank (``None``: no bound);
    ``None`` if every rank reaches its end, else where each stuck rank waits."""
    programs = {r: primitive_ops(plan, r, forward_only) for r in plan.programs}
    pc = {r: 0 for r in programs}
    sent_channels = {r: [op.channel for op in ops if op.what == SEND] for r, ops in programs.items()}
    sends_done = {r: 0 for r in programs}
    posted_sends: set = set()
    posted_recvs: set = set()
    progress = True
    while progress:
        progress = False
        for r, ops in programs.items():
            while pc[r] < len(ops):
                op = ops[pc[r]]
                if op.what == SEND:
                    n = sends_done[r]
                    if bound is not None and n >= bound and sent_channels[r][n - bound] not in posted_recvs:
                        break
                    sends_done[r] += 1
                    posted_sends.add(op.channel)
                elif op.what == PUT:
                    posted_sends.add(op.channel)
                elif op.what == RECV:
                    posted_recvs.add(op.channel)
                    if op.channel not in posted_sends:
                        break
                pc[r] += 1
                progress = True
    stuck = []
    for r, ops in sorted(programs.items()):
        if pc[r] < len(ops):
            op = ops[pc[r]]
            waits = "its receive of an earlier send" if op.what == SEND else "the matching send"
            stuck.append(f"{where(r, op.index, plan.programs[r][op.index])} waits for {waits}")
    return "; ".join(stuck) or None


def plan_send_bound(plan: Plan, forward_only: bool = False) -> int:
    """The most sends any rank of ``plan`` can hold alive in any interleaving (at least 1).

    For each rank and each of its sends: the least every other rank must have done for this
    rank to get there (the closure of its receives' senders), and how many of this rank's
    sends are then still unreceived, from the oldest on.  Raises :class:`.ScheduleError` if the
    executor's sequential replay cannot finish the plan even without a bound."""
    stuck = deadlock_with_bound(plan, None, forward_only)
    if stuck is not None:
        raise ScheduleError(f"the runtime, which runs a batch of transfers in program order, "
                            f"cannot run this plan: {stuck}")
    programs = {r: primitive_ops(plan, r, forward_only) for r in plan.programs}
    sender = {op.channel: (r, j) for r, ops in programs.items() for j, op in enumerate(ops)
              if op.what in (SEND, PUT)}
    receiver = {op.channel: (r, j) for r, ops in programs.items() for j, op in enumerate(ops) if op.what == RECV}
    peak = 1
    for r, ops in programs.items():
        done = {s: 0 for s in programs}  # ops completed in the least cut
        sends: list[tuple[int, int]] = []  # this rank's sends so far: receiver (rank, op index)
        oldest = 0
        for j, op in enumerate(ops):
            _complete_up_to(programs, sender, done, r, j + 1)
            if op.what != SEND:
                continue
            sends.append(receiver[op.channel])
            while oldest < len(sends) and sends[oldest][1] < done[sends[oldest][0]]:
                oldest += 1
            peak = max(peak, len(sends) - oldest)
    return peak


def _complete_up_to(programs: dict, sender: dict, done: dict, rank: int, count: int) -> None:
    """Grow the least cut so that ``rank`` has completed its first ``count`` ops: every
    receive inside needs its sender to have posted the send, transitively."""
    todo = [(rank, count)]
    while todo:
        r, upto = todo.pop()
        start = done[r]
        if upto <= start:
            continue
        done[r] = upto
        for op in programs[r][start:upto]:
            if op.what == RECV:
                s, j = sender[op.channel]
                todo.append((s, j + 1))
