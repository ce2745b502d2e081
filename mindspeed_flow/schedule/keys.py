"""The schedule's wire names, typed: boundary keys and collective channels.

A tensor that crosses ranks is named by the boundary it crosses and what it is:
``"<region>.s<stage>:act|grad|input"`` - the output of visit ``region.s<stage>`` (``act``),
the gradient of that output coming back (``grad``), or the region's input shipped to where
a recomputed backward runs (``input``); ``weight`` names, inside one rank, the output
gradient a split backward keeps for its ``W``.  With the microbatch, the key fixes the
tensor's shape.  A replicated region's parameter broadcast and gradient reduce travel on
``"BCAST:<region>"`` and ``"REDUCE:<region>"``.

Both are ``str`` subclasses: they print, sort, hash and compare as the text programs and
listings carry (``Action.key``, the runtime's channels and tags), and carry their parts as
typed attributes, so no module parses a key by its suffix.  :meth:`BoundaryKey.parse` and
``str()`` are the one parse and the one format.
"""

from __future__ import annotations

import re
from enum import Enum

from .errors import ScheduleError

_BOUNDARY = re.compile(r"^(?P<region>\S+)\.s(?P<stage>\d+):(?P<kind>\w+)$")


class BoundaryKind(str, Enum):
    """What crosses a boundary; the value is the key's suffix."""

    ACT = "act"  # the visit's output, forward
    GRAD = "grad"  # the gradient of that output, backward
    INPUT = "input"  # a recomputed region's input, to the rank of its backward
    WEIGHT = "weight"  # (one rank) the output gradient a split backward keeps for W
    # No data: a flow plan's consumer took a sample's entry, which frees a slot of its
    # producer's in-flight window (``mindspeed_flow.flow.plan.compose_flow_steps``).
    TAKEN = "taken"


class BoundaryKey(str):
    """``"<region>.s<stage>:<kind>"``, with ``region``, ``stage`` and ``kind`` attributes."""

    region: str
    stage: int
    kind: BoundaryKind

    def __new__(cls, region: str, stage: int, kind: BoundaryKind | str) -> BoundaryKey:
        kind = BoundaryKind(kind)
        self = super().__new__(cls, f"{region}.s{stage}:{kind.value}")
        self.region, self.stage, self.kind = region, int(stage), kind
        return self

    @classmethod
    def parse(cls, text: str) -> BoundaryKey:
        """Read ``"vit.s0:act"``; raises :class:`.ScheduleError` naming the fault."""
        if isinstance(text, BoundaryKey):
            return text
        match = _BOUNDARY.match(str(text).strip())
        kinds = [k.value for k in BoundaryKind]
        if not match or match["kind"] not in kinds:
            raise ScheduleError(f"boundary key {text!r}: expected `<region>.s<stage>:<kind>` with kind one of {kinds}")
        return cls(match["region"], int(match["stage"]), match["kind"])

    @property
    def tag(self) -> str:
        """The visit the key belongs to, ``"<region>.s<stage>"`` (:attr:`.Visit.tag`)."""
        return f"{self.region}.s{self.stage}"

    def of(self, kind: BoundaryKind) -> BoundaryKey:
        """The same boundary's key for ``kind``."""
        return BoundaryKey(self.region, self.stage, kind)

    def __getnewargs__(self) -> tuple:  # pickling (results cross processes)
        return self.region, self.stage, self.kind.value

    def __repr__(self) -> str:
        return str.__repr__(self)


class CollectiveKey(str):
    """``"BCAST:<region>"`` / ``"REDUCE:<region>"``: the channel of a replicated region's
    collective (both directions of a reduce), with ``kind`` (a ``Kind``) and ``region``."""

    kind: Enum
    region: str

    def __new__(cls, kind: Enum, region: str) -> CollectiveKey:
        self = super().__new__(cls, f"{kind.value}:{region}")
        self.kind, self.region = kind, region
        return self

    def __getnewargs__(self) -> tuple:
        return self.kind, self.region

    def __repr__(self) -> str:
        return str.__repr__(self)
