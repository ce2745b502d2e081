"""Typed actions: a schedule is data.

A per-rank program is a plain list of :class:`Action` values that one runtime executes,
that prints one readable line per action, and that the validator and the simulator read
without running a model (the same idea as ``torch.distributed.pipelining``'s ``_Action``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

from .errors import ScheduleError
from .keys import BoundaryKey, BoundaryKind


class Kind(str, Enum):
    """What an action does; the value is the short name printed in programs."""

    FORWARD = "F"
    BACKWARD = "B"  # input and weight gradients in one pass: a trainable region
    # Input gradients: the whole backward of a frozen region on the gradient path, or the
    # first half of a trainable region's backward under a zero-bubble skeleton, whose
    # weight gradients follow as W.
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"  # weight gradients only: the second half of a split backward
    SEND_ACT = "SEND_A"
    RECV_ACT = "RECV_A"
    SEND_GRAD = "SEND_G"
    RECV_GRAD = "RECV_G"
    POOL_PUT = "PUT"
    POOL_GET = "GET"
    PARAM_BROADCAST = "BCAST"
    GRAD_REDUCE = "REDUCE"


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
BACKWARDS = frozenset({Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
SENDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD, Kind.POOL_PUT})
RECVS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD, Kind.POOL_GET})
COLLECTIVES = frozenset({Kind.PARAM_BROADCAST, Kind.GRAD_REDUCE})
# The receive that completes each point-to-point send.
MATCHING_RECV = {Kind.SEND_ACT: Kind.RECV_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD}
# What ``str(action)`` prints, read back by :meth:`Action.from_str`.
_TEXT = re.compile(
    r"^(?P<kind>\S+)\s+(?P<region>\S+?)\.s(?P<stage>\d+)"
    r"(?:\s+mb(?P<microbatch>\d+))?"
    r"(?:\s+smp(?P<sample>\d+))?"
    r"(?:\s+(?P<arrow>->|<-)\s*r(?P<peer>\d+))?"
    r"(?:\s+\[(?P<key>[^\]]+)\])?"
    r"(?:\s+group=\[(?P<group>[\d,\s]*)\])?\s*$"
)


@dataclass(frozen=True)
class Action:
    """One step of a rank's program.

    Attributes:
        kind: what the step does.
        region: the region it belongs to.
        stage: the region's (virtual) pipeline stage; 0 for a replicated region.
        microbatch: the microbatch, or ``None`` for per-step collectives.
        peer: the other rank of a transfer (for pool put/get: the rank on the other side).
        key: the :class:`.BoundaryKey` of a transferred tensor (``"<region>.s<stage>:act|grad"``
            naming the boundary whose output, or output gradient, travels; with the microbatch
            it fixes the tensor's shape, which varies per microbatch under packing); ``""``
            for computes and collectives.  Given as text it is parsed (:meth:`.BoundaryKey.parse`).
        group: the ranks of a collective.
        sample: the sample a per-sample pool transfer carries (a flow plan, see
            :mod:`mindspeed_flow.flow.plan`: the encoder puts each sample's embeddings and the
            backbone gets them by sample, whatever their groups); ``None`` otherwise.
    """

    kind: Kind
    region: str
    stage: int = 0
    microbatch: int | None = None
    peer: int | None = None
    key: BoundaryKey | str = ""
    group: tuple[int, ...] = ()
    sample: int | None = None

    def __post_init__(self) -> None:
        if self.key and not isinstance(self.key, BoundaryKey):
            object.__setattr__(self, "key", BoundaryKey.parse(self.key))

    @property
    def carries(self) -> BoundaryKind | None:
        """What the transferred tensor is (``key.kind``); ``None`` without a key."""
        return self.key.kind if self.key else None

    @classmethod
    def from_str(cls, text: str) -> Action:
        """Parse what ``str(action)`` prints (``SEND_A llm.s0 mb3 -> r1 [llm.s0:act]``,
        ``PUT vit.s0 mb0 smp7 -> r2 [vit.s0:act]``),
        so hand-edited programs can be read back; raises :class:`.ScheduleError` naming the
        fault."""
        match = _TEXT.match(text.strip())
        if not match:
            raise ScheduleError(
                f"cannot read action {text.strip()!r}: expected `KIND region.sSTAGE [mbN] [smpS] "
                "[-> rP | <- rP] [[key]] [group=[r, ...]]`"
            )
        try:
            kind = Kind(match["kind"])
        except ValueError:
            raise ScheduleError(
                f"action {text.strip()!r}: unknown kind {match['kind']!r}, expected one of "
                f"{[k.value for k in Kind]}"
            ) from None
        arrow = match["arrow"]
        wanted = "->" if kind in SENDS else "<-" if kind in RECVS else None
        if arrow != wanted:
            raise ScheduleError(
                f"action {text.strip()!r}: a {kind.value} takes "
                + (f"`{wanted} r<peer>`" if wanted else "no peer")
            )
        group = tuple(int(r) for r in match["group"].replace(",", " ").split()) if match["group"] else ()
        try:
            key = BoundaryKey.parse(match["key"]) if match["key"] else ""
        except ScheduleError as exc:
            raise ScheduleError(f"action {text.strip()!r}: {exc}") from None
        return cls(
            kind,
            match["region"],
            int(match["stage"]),
            None if match["microbatch"] is None else int(match["microbatch"]),
            peer=None if match["peer"] is None else int(match["peer"]),
            key=key,
            group=group,
            sample=None if match["sample"] is None else int(match["sample"]),
        )

    def __str__(self) -> str:
        text = f"{self.kind.value:<6} {self.region}.s{self.stage}"
        if self.microbatch is not None:
            text += f" mb{self.microbatch}"
        if self.sample is not None:
            text += f" smp{self.sample}"
        if self.peer is not None:
            text += f" {'->' if self.kind in SENDS else '<-'} r{self.peer}"
        if self.key:
            text += f" [{self.key}]"
        if self.group:
            text += f" group={list(self.group)}"
        return text


def format_program(rank: int, program: Sequence[Action]) -> str:
    """Render one rank's program, one numbered line per action."""
    return "\n".join(f"r{rank} #{i:<3} {action}" for i, action in enumerate(program))
