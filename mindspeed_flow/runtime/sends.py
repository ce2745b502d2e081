"""How many send buffers a plan keeps alive: the runtime's bound, derived from the plan.

The validator replays programs under *eager* semantics: a send never waits.  The runtime
keeps a sent tensor's buffer until the transfer completes, and completes sends in posting
order (one waiter thread per rank), so at any moment a rank holds the span of sends from its
oldest incomplete one to its newest.  A bound ``K`` on that span makes send ``n`` wait until
sends ``0..n-K`` completed, i.e. until their receives were posted (gloo completes a send once
the receive is posted) - progress of *other* ranks that the validator never asked for.

This module replays the plan's lowering (:mod:`.lowering`), the list of operations the
executor runs, one primitive transfer at a time (a ``BCAST`` / ``REDUCE`` is its messages,
a batch of transfers runs in program order, not posted at once):

- :func:`plan_send_bound`: the largest span any rank can reach in *any* interleaving of the
  ranks (each rank at a send, every other rank as far behind as that send's dependencies
  allow).  With it as the bound no send ever waits for another rank: the plan runs exactly as
  the validator executed it, and its in-flight limits (``max_in_flight``) bound the buffers
  through the plan's own dependencies.  It is the runtime's default.
- :func:`deadlock_with_bound`: the replay with a given bound (``None``: unbounded), so an
  explicit, smaller bound is refused if it can deadlock the plan, and a plan whose batch
  order the executor cannot run in sequence is refused before anything runs.

Both take a :class:`.Plan` (lowered here) or the executor's own :class:`.Lowered` plan.
"""

from __future__ import annotations

from ..schedule.errors import ScheduleError
from ..schedule.plan import Plan
from .errors import where
from .lowering import BLOCKING, Lowered, OpKind, as_lowered

SEND, PUT = OpKind.SEND, OpKind.PUT


def deadlock_with_bound(plan: Plan | Lowered, bound: int | None, forward_only: bool = False) -> str | None:
    """Replay the executor with at most ``bound`` sends alive per rank (``None``: no bound);
    ``None`` if every rank reaches its end, else where each stuck rank waits."""
    programs = as_lowered(plan, forward_only).programs
    pc = {r: 0 for r in programs}
    sent = {r: [op.message for op in ops if op.kind is SEND] for r, ops in programs.items()}
    sends_done = {r: 0 for r in programs}
    posted_sends: set = set()
    posted_recvs: set = set()
    progress = True
    while progress:
        progress = False
        for r, ops in programs.items():
            while pc[r] < len(ops):
                op = ops[pc[r]]
                if op.kind is SEND:
                    n = sends_done[r]
                    if bound is not None and n >= bound and sent[r][n - bound] not in posted_recvs:
                        break
                    sends_done[r] += 1
                    posted_sends.add(op.message)
                elif op.kind is PUT:
                    posted_sends.add(op.message)
                elif op.kind in BLOCKING:
                    posted_recvs.add(op.message)
                    if op.message not in posted_sends:
                        break
                pc[r] += 1
                progress = True
    stuck = []
    for r, ops in sorted(programs.items()):
        if pc[r] < len(ops):
            op = ops[pc[r]]
            waits = "its receive of an earlier send" if op.kind is SEND else "the matching send"
            stuck.append(f"{where(r, op.index, op.action)} waits for {waits}")
    return "; ".join(stuck) or None


def plan_send_bound(plan: Plan | Lowered, forward_only: bool = False) -> int:
    """The most sends any rank of ``plan`` can hold alive in any interleaving (at least 1).

    For each rank and each of its sends: the least every other rank must have done for this
    rank to get there (the closure of its receives' senders), and how many of this rank's
    sends are then still unreceived, from the oldest on.  Raises :class:`.ScheduleError` if the
    executor's sequential replay cannot finish the plan even without a bound."""
    lowered = as_lowered(plan, forward_only)
    stuck = deadlock_with_bound(lowered, None)
    if stuck is not None:
        raise ScheduleError(f"the runtime, which runs a batch of transfers in program order, "
                            f"cannot run this plan: {stuck}")
    programs = lowered.programs
    sender = {op.message: (r, j) for r, ops in programs.items() for j, op in enumerate(ops)
              if op.kind in (SEND, PUT)}
    receiver = {op.message: (r, j) for r, ops in programs.items() for j, op in enumerate(ops)
                if op.kind in BLOCKING}
    peak = 1
    for r, ops in programs.items():
        done = {s: 0 for s in programs}  # ops completed in the least cut
        sends: list[tuple[int, int]] = []  # this rank's sends so far: receiver (rank, op index)
        oldest = 0
        for j, op in enumerate(ops):
            _complete_up_to(programs, sender, done, r, j + 1)
            if op.kind is not SEND:
                continue
            sends.append(receiver[op.message])
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
            if op.kind in BLOCKING:
                s, j = sender[op.message]
                todo.append((s, j + 1))
