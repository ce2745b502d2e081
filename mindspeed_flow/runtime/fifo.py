"""Whether a plan's point-to-point messages match on a backend that ignores tags.

gloo matches a receive to a send by tag, so the runtime may post a pair's messages in any
order on either side.  NCCL (and HCCL on Ascend) ignore the tag: the messages from one rank to
another match in posting order.  There the plan runs as validated only if, for every ordered
pair ``(src, dst)``, the order in which ``src`` posts its sends to ``dst`` equals the order in
which ``dst`` posts its receives from ``src`` - as the executor posts them: the plan's
lowering (:mod:`.lowering`, ``BCAST`` / ``REDUCE`` expanded into their messages, a receive
posted when its operation runs, never ahead of time).  Pool puts and gets are not messages.

The runtime can relax the condition by giving each message *channel* its own communicator
(``RuntimeOptions.channel_groups``): a channel is the plan key a transfer travels under (a
region boundary's activations, its gradients, a parameter broadcast or gradient reduce of a
region - :attr:`.Message.channel`, the key the executor numbers tags by, without the
microbatch).  Messages of
different channels then never meet in one FIFO, so the order must agree only per
``(src, dst, channel)``, which the validator's per-key pairing already asks for.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedule.errors import ScheduleError
from ..schedule.plan import Plan
from .errors import where
from .lowering import Lowered, Op, OpKind, as_lowered

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
    channel: str | None = None  # set when the order is checked per channel

    def __str__(self) -> str:
        send = f"r{self.src} posts {self.send}" if self.send else f"r{self.src} posts no send"
        recv = f"r{self.dst} posts {self.recv}" if self.recv else f"r{self.dst} posts no receive"
        on = f" on channel {self.channel}" if self.channel is not None else ""
        return f"r{self.src} -> r{self.dst}{on}: message {self.n + 1}: {send}, {recv}"


def needs_fifo_order(backend: str) -> bool:
    """``True`` for a backend that matches point-to-point messages in posting order (every
    backend but gloo: nccl, hccl, ...)."""
    return str(backend).lower() not in TAG_MATCHING_BACKENDS


def _messages(plan: Plan | Lowered) -> list[tuple[int, Op, str]]:
    """Every point-to-point message end of ``plan``'s lowering: (rank, SEND or RECV op, where)."""
    return [(rank, op, where(rank, op.index, op.action)) for rank, op in as_lowered(plan).messages()]


def channel_groups(plan: Plan | Lowered) -> list[tuple[str, tuple[int, ...]]]:
    """The communicators a plan needs when each channel gets its own: ``(channel, plan ranks
    that use it)``, sorted by channel - the same list on every rank, so every rank creates
    the groups in the same order."""
    users: dict[str, set[int]] = {}
    for _, op, _ in _messages(plan):
        users.setdefault(op.message.channel, set()).update((op.message.src, op.message.dst))
    return [(key, tuple(sorted(ranks))) for key, ranks in sorted(users.items())]


def fifo_mismatches(plan: Plan | Lowered, per_channel: bool = False) -> list[Mismatch]:
    """Per ordered pair of ranks (and per channel, with ``per_channel``: one communicator per
    channel), the first message where the sender's posting order and the receiver's differ;
    empty if the plan runs unchanged on a backend that ignores tags."""
    sends: dict[tuple, list[tuple]] = {}
    recvs: dict[tuple, list[tuple]] = {}
    for _, op, place in _messages(plan):
        message = op.message
        fifo = (message.src, message.dst, str(message.channel) if per_channel else None)
        (sends if op.kind is OpKind.SEND else recvs).setdefault(fifo, []).append((message, place))
    found = []
    for src, dst, key in sorted(sends.keys() | recvs.keys(), key=lambda f: (f[0], f[1], f[2] or "")):
        posted, awaited = sends.get((src, dst, key), []), recvs.get((src, dst, key), [])
        for n in range(max(len(posted), len(awaited))):
            send = posted[n] if n < len(posted) else (None, None)
            recv = awaited[n] if n < len(awaited) else (None, None)
            if send[0] != recv[0]:
                found.append(Mismatch(src, dst, n, send[1], recv[1], key))
                break
    return found


def check_posting_order(plan: Plan | Lowered, backend: str, per_channel: bool = False) -> None:
    """Refuse, before the first step, a plan whose messages would mismatch on ``backend``
    (nothing to check on gloo, which matches by tag; ``per_channel``: each channel has its
    own communicator).  Raises :class:`.ScheduleError` naming every disagreeing pair and its
    first mismatching pair of actions."""
    if not needs_fifo_order(backend):
        return
    found = fifo_mismatches(plan, per_channel)
    if found:
        how = "per channel" if per_channel else "in one communicator per pair"
        raise ScheduleError(
            f"backend {backend!r} matches point-to-point messages in posting order, not by tag, "
            f"and this plan's sends and receives are posted in different orders {how}: "
            f"{'; '.join(map(str, found))}. Such a plan cannot run on {backend}; it can run on gloo")
