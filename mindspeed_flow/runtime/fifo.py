"""Whether a plan's point-to-point messages match on a backend that ignores tags.

gloo matches a receive to a send by tag, so the runtime may post a pair's messages in any
order on either side.  NCCL (and HCCL on Ascend) ignore the tag: the messages from one rank to
another match in posting order.  There the plan runs as validated only if, for every ordered
pair ``(src, dst)``, the order in which ``src`` posts its sends to ``dst`` equals the order in
which ``dst`` posts its receives from ``src`` - as the executor posts them
(:func:`.sends.primitive_ops`: ``BCAST`` / ``REDUCE`` expanded into their messages, a receive
posted when its action runs, never ahead of time).  Pool puts and gets are not messages.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule.errors import ScheduleError
from ..schedule.plan import Plan
from .errors import where
from .sends import RECV, SEND, primitive_ops

TAG_MATCHING_BACKENDS = frozenset({"gloo"})


@dataclass(frozen=True)
class Mismatch:
    """The first message of pair ``src -> dst`` whose send and receive differ (``None``: that
    side has no ``n``-th message), as ``where`` strings of the posting actions."""

    src: int
    dst: int
    n: int
    send: str | None
    recv: str | None

    def __str__(self) -> str:
        send = f"r{self.src} posts {self.send}" if self.send else f"r{self.src} posts no send"
        recv = f"r{self.dst} posts {self.recv}" if self.recv else f"r{self.dst} posts no receive"
        return f"r{self.src} -> r{self.dst}: message {self.n + 1}: {send}, {recv}"


def needs_fifo_order(backend: str) -> bool:
    """``True`` for a backend that matches point-to-point messages in posting order (every
    backend but gloo: nccl, hccl, ...)."""
    return str(backend).lower() not in TAG_MATCHING_BACKENDS


def fifo_mismatches(plan: Plan) -> list[Mismatch]:
    """Per ordered pair of ranks, the first message where the sender's posting order and the
    receiver's differ; empty if the plan runs unchanged on a backend that ignores tags."""
    sends: dict[tuple[int, int], list[tuple]] = {}
    recvs: dict[tuple[int, int], list[tuple]] = {}
    for rank in plan.programs:
        for op in primitive_ops(plan, rank):
            if op.what not in (SEND, RECV) or op.channel[0] == "pool":
                continue
            src, dst = op.channel[0], op.channel[1]
            side = sends if op.what == SEND else recvs
            side.setdefault((src, dst), []).append((op.channel, where(rank, op.index, plan.programs[rank][op.index])))
    found = []
    for src, dst in sorted(sends.keys() | recvs.keys()):
        posted, awaited = sends.get((src, dst), []), recvs.get((src, dst), [])
        for n in range(max(len(posted), len(awaited))):
            send = posted[n] if n < len(posted) else (None, None)
            recv = awaited[n] if n < len(awaited) else (None, None)
            if send[0] != recv[0]:
                found.append(Mismatch(src, dst, n, send[1], recv[1]))
                break
    return found


def check_posting_order(plan: Plan, backend: str) -> None:
    """Refuse, before the first step, a plan whose messages would mismatch on ``backend``
    (nothing to check on gloo, which matches by tag).  Raises :class:`.ScheduleError` naming
    every disagreeing pair and its first mismatching pair of actions."""
    if not needs_fifo_order(backend):
        return
    found = fifo_mismatches(plan)
    if found:
        raise ScheduleError(
            f"backend {backend!r} matches point-to-point messages in posting order, not by tag, "
            f"and this plan's sends and receives are posted in different orders: "
            f"{'; '.join(map(str, found))}. Such a plan (e.g. an eager <transpose, 1f1b> plan) "
            f"cannot run on {backend} yet; it can run on gloo")
