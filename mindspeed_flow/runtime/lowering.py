"""Lowering: a plan's actions -> the operations the runtime executes, every message explicit.

A :class:`.Plan`'s programs are what the schedule algebra composes, validates and simulates:
computes, point-to-point transfers, pool transfers and per-step collectives, one action
each.  The runtime does not run actions; it runs their lowering (as
``torch.distributed.pipelining`` lowers compute-only orders to programs with every send and
receive): per rank a list of :class:`Op`, each one primitive step of one action,

- ``COMPUTE``: the action's ``F`` / ``B`` / ``I`` / ``W``;
- ``SEND`` / ``RECV``: one tensor :class:`Message` (a shape header and the data, :mod:`.transport`);
- ``PUT`` / ``GET``: one tensor through the pool (a :class:`Message` from putter to getter,
  no communicator);
- ``PACK`` / ``UNPACK``: a collective's parameters or gradients flattened into one buffer,
  and the buffer written back.

A ``BCAST`` of a replicated region: the root packs its parameters and sends them to each
member in group order; a member receives and unpacks them.  A ``REDUCE``: every replica
packs its gradients; the root receives each member's in group order, adding them to its own,
and sends the sum to each member; every replica unpacks the sum into its gradients.

The executor (:mod:`.executor`) runs exactly this list, and :mod:`.sends` (send-buffer
bound, deadlock replay) and :mod:`.fifo` (posting order per pair and channel) analyse the
same list, so the order they prove is the order that runs.  Every message carries its
channel (a :class:`.BoundaryKey` or a :class:`.CollectiveKey`) and its tag, numbered from
the plan (the same on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterator, Mapping

from ..schedule.actions import BACKWARDS, COMPUTE, Action, Kind
from ..schedule.errors import ScheduleError
from ..schedule.keys import BoundaryKey, BoundaryKind, CollectiveKey
from ..schedule.plan import Plan
from .errors import where

Channel = BoundaryKey | CollectiveKey

# What a forward-only step (Megatron's evaluation) leaves out.
SKIPPED_WHEN_FORWARD_ONLY = BACKWARDS | {Kind.SEND_GRAD, Kind.RECV_GRAD, Kind.GRAD_REDUCE}


class OpKind(str, Enum):
    COMPUTE = "compute"
    SEND = "send"
    RECV = "recv"
    PUT = "put"
    GET = "get"
    PACK = "pack"
    UNPACK = "unpack"


class Payload(str, Enum):
    """What a message (or a collective's buffer) holds."""

    ACT = "act"  # a boundary's activation
    GRAD = "grad"  # a boundary's gradient
    INPUT = "input"  # a recomputed region's input
    PARAMS = "params"  # a replicated region's parameters (BCAST)
    GRADS = "grads"  # one replica's gradients (REDUCE, to the root)
    SUM = "sum"  # the replicas' summed gradients (REDUCE, from the root)


_BOUNDARY_PAYLOAD = {BoundaryKind.ACT: Payload.ACT, BoundaryKind.GRAD: Payload.GRAD,
                     BoundaryKind.INPUT: Payload.INPUT}
BLOCKING = frozenset({OpKind.RECV, OpKind.GET})  # wait for their message's sender
MESSAGES = frozenset({OpKind.SEND, OpKind.RECV})  # point-to-point, over a communicator


@dataclass(frozen=True)
class Message:
    """One tensor from plan rank ``src`` to ``dst`` on ``channel`` (``microbatch``: ``None``
    for a collective's), with the tag both ends post it under."""

    src: int
    dst: int
    channel: Channel
    microbatch: int | None
    payload: Payload
    tag: int

    def __str__(self) -> str:
        what = f" {self.payload.value}" if self.microbatch is None else f" mb{self.microbatch}"
        return f"[{self.channel}]{what} r{self.src}->r{self.dst} tag={self.tag}"


@dataclass(frozen=True)
class Op:
    """One primitive step of action ``index`` (``action``) of a rank's program."""

    kind: OpKind
    index: int
    action: Action
    message: Message | None = None  # SEND, RECV, PUT, GET
    payload: Payload | None = None  # PACK, UNPACK (a message's is message.payload)

    def __str__(self) -> str:
        if self.message is not None:
            return f"{self.kind.value:<7} {self.message}"
        if self.payload is not None:
            return f"{self.kind.value:<7} {self.payload.value} of {self.action.region}"
        return f"{self.kind.value:<7} {' '.join(str(self.action).split())}"


def channel_of(action: Action) -> Channel:
    """The channel a transfer or collective travels on: its boundary key, or
    ``"<kind>:<region>"`` for a collective."""
    return action.key if action.key else CollectiveKey(action.kind, action.region)


def number_tags(plan: Plan) -> dict[tuple[Channel, int | None], int]:
    """(channel, microbatch or ``None``) -> tag: channels in sorted order, one slot per
    microbatch and one for the step's collectives."""
    channels = sorted({channel_of(a) for p in plan.programs.values() for a in p if a.kind not in COMPUTE})
    slots = plan.num_microbatches + 1
    return {(c, m): i * slots + (plan.num_microbatches if m is None else m)
            for i, c in enumerate(channels) for m in [*range(plan.num_microbatches), None]}


@dataclass(frozen=True)
class Lowered:
    """A plan lowered for one kind of step: rank -> its operations, in execution order."""

    plan: Plan
    forward_only: bool
    programs: Mapping[int, tuple[Op, ...]]

    def messages(self) -> Iterator[tuple[int, Op]]:
        """Every point-to-point message end: (rank, its SEND or RECV op)."""
        for rank, ops in self.programs.items():
            for op in ops:
                if op.kind in MESSAGES:
                    yield rank, op

    def format(self) -> str:
        """Every rank's operations, one line each, numbered by the action they lower."""
        return "\n".join(f"r{rank} #{op.index:<3} {op}" for rank, ops in sorted(self.programs.items())
                         for op in ops)


def lower(plan: Plan, forward_only: bool = False) -> Lowered:
    """Every rank's program of ``plan`` as the runtime runs it (``forward_only``: without
    backwards, gradient transfers and reduces).  A flow plan is refused (see
    :func:`refuse_per_sample`)."""
    refuse_per_sample(plan)
    tags = number_tags(plan)
    return Lowered(plan, forward_only, {rank: tuple(_lower_program(rank, program, tags, forward_only))
                                        for rank, program in plan.programs.items()})


def refuse_per_sample(plan: Plan) -> None:
    """Raise :class:`.ScheduleError` naming the first per-sample pool transfer of ``plan``: a
    flow plan (:mod:`mindspeed_flow.flow.plan`) moves each sample's embeddings on its own, and
    the runtime's messages are addressed by (key, microbatch), so it cannot run one yet."""
    for rank, program in sorted(plan.programs.items()):
        for i, a in enumerate(program):
            if a.sample is not None:
                raise ScheduleError(
                    f"{where(rank, i, a)}: a flow plan (per-sample pool transfers) cannot "
                    "run in the runtime yet: its pool messages are addressed by (key, microbatch), not by "
                    "sample; simulate the plan instead (mindspeed_flow.schedule.simulate)")


def as_lowered(plan: Plan | Lowered, forward_only: bool = False) -> Lowered:
    """``plan`` itself if already lowered, else its lowering."""
    return plan if isinstance(plan, Lowered) else lower(plan, forward_only)


def _skipped(a: Action) -> bool:
    return a.kind in SKIPPED_WHEN_FORWARD_ONLY or a.kind in (Kind.POOL_PUT, Kind.POOL_GET) \
        and a.carries is BoundaryKind.GRAD


def _lower_program(rank: int, program, tags: dict, forward_only: bool) -> Iterator[Op]:
    for i, a in enumerate(program):
        if forward_only and _skipped(a):
            continue
        if a.kind in COMPUTE:
            yield Op(OpKind.COMPUTE, i, a)
        elif a.kind is Kind.PARAM_BROADCAST:
            yield from _broadcast(rank, i, a, tags)
        elif a.kind is Kind.GRAD_REDUCE:
            yield from _reduce(rank, i, a, tags)
        else:
            outgoing = a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD, Kind.POOL_PUT)
            kind = {Kind.POOL_PUT: OpKind.PUT, Kind.POOL_GET: OpKind.GET}.get(
                a.kind, OpKind.SEND if outgoing else OpKind.RECV)
            src, dst = (rank, a.peer) if outgoing else (a.peer, rank)
            payload = _BOUNDARY_PAYLOAD[a.key.kind]
            yield Op(kind, i, a, Message(src, dst, a.key, a.microbatch, payload, tags[(a.key, a.microbatch)]))


def _broadcast(rank: int, i: int, a: Action, tags: dict) -> Iterator[Op]:
    root, members = a.group[0], a.group[1:]
    channel = channel_of(a)
    tag = tags[(channel, None)]
    if rank == root:
        yield Op(OpKind.PACK, i, a, payload=Payload.PARAMS)
        for m in members:
            yield Op(OpKind.SEND, i, a, Message(root, m, channel, None, Payload.PARAMS, tag))
        return
    yield Op(OpKind.RECV, i, a, Message(root, rank, channel, None, Payload.PARAMS, tag))
    yield Op(OpKind.UNPACK, i, a, payload=Payload.PARAMS)


def _reduce(rank: int, i: int, a: Action, tags: dict) -> Iterator[Op]:
    root, members = a.group[0], a.group[1:]
    channel = channel_of(a)
    tag = tags[(channel, None)]
    yield Op(OpKind.PACK, i, a, payload=Payload.GRADS)
    if rank == root:
        for m in members:
            yield Op(OpKind.RECV, i, a, Message(m, root, channel, None, Payload.GRADS, tag))
        for m in members:
            yield Op(OpKind.SEND, i, a, Message(root, m, channel, None, Payload.SUM, tag))
    else:
        yield Op(OpKind.SEND, i, a, Message(rank, root, channel, None, Payload.GRADS, tag))
        yield Op(OpKind.RECV, i, a, Message(root, rank, channel, None, Payload.SUM, tag))
    yield Op(OpKind.UNPACK, i, a, payload=Payload.SUM)
