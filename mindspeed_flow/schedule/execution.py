"""Symbolic execution of programs under blocking semantics (no model, no clock).

Every rank advances while its next step may complete: a compute always may; a batch of
consecutive transfers (posted together) may when each of its operations has met what it
needs; a collective may when all its members have reached it.  What an operation needs
depends on the semantics (see :mod:`.validate`).  The run ends when no rank can advance;
the programs are deadlock-free exactly when every rank has reached its end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .actions import COLLECTIVES, COMPUTE, RECVS, SENDS, Action, Kind
from .pairing import Pairing, Ref

SEMANTICS = ("rendezvous", "eager")


@dataclass(frozen=True)
class Outcome:
    """Where each rank stopped and, for a stuck rank, its blocked ops with what they wait for."""

    pc: dict[int, int]
    blocked: dict[int, list[tuple[Ref, Ref]]]

    @property
    def finished(self) -> bool:
        return not self.blocked


def step_end(program: Sequence[Action], start: int) -> int:
    """End of the step starting at ``start``: one compute or collective, or a transfer batch."""
    if program[start].kind in COMPUTE or program[start].kind in COLLECTIVES:
        return start + 1
    end = start
    while end < len(program) and (program[end].kind in SENDS or program[end].kind in RECVS):
        end += 1
    return end


def execute(programs: Mapping[int, Sequence[Action]], pairing: Pairing, semantics: str) -> Outcome:
    """Advance every rank as far as ``semantics`` lets it; the outcome says where each
    stopped.  Ranks are swept until a sweep moves none: the order of the sweep cannot change
    the end state, because a step that may complete stays completable."""
    rendezvous = semantics == "rendezvous"
    pc = {rank: 0 for rank in programs}
    posted: set[Ref] = set()

    def waits_for(ref: Ref) -> Ref | None:
        a = programs[ref[0]][ref[1]]
        if a.kind in COMPUTE:
            return None
        if a.kind in COLLECTIVES:
            return next((m for m in pairing.members[ref] if m not in posted), None)
        if a.kind is Kind.POOL_PUT or (a.kind in SENDS and not rendezvous):
            return None
        other = pairing.partner[ref]
        return None if other in posted else other

    progress = True
    while progress:
        progress = False
        for rank, program in programs.items():
            while pc[rank] < len(program):
                ops = [(rank, j) for j in range(pc[rank], step_end(program, pc[rank]))]
                posted.update(ops)
                if any(waits_for(op) for op in ops):
                    break
                pc[rank] = ops[-1][1] + 1
                progress = True
    blocked = {}
    for rank, program in programs.items():
        if pc[rank] < len(program):
            ops = [(rank, j) for j in range(pc[rank], step_end(program, pc[rank]))]
            blocked[rank] = [(op, w) for op in ops if (w := waits_for(op))]
    return Outcome(pc, blocked)


def explain(programs: Mapping[int, Sequence[Action]], outcome: Outcome, semantics: str) -> str:
    """Name every stuck rank, the op it is blocked at and whom it waits for."""

    def where(rank: int) -> str:
        pc = outcome.pc[rank]
        return f"is at #{pc} `{programs[rank][pc]}`" if pc < len(programs[rank]) else "has finished"

    parts = []
    for rank, ops in sorted(outcome.blocked.items()):
        op, other = ops[0]
        parts.append(
            f"rank {rank} blocked at action #{op[1]} `{programs[rank][op[1]]}` waiting for "
            f"action #{other[1]} `{programs[other[0]][other[1]]}` of rank {other[0]} "
            f"(rank {other[0]} {where(other[0])})"
        )
    return f"deadlock under {semantics} semantics: " + "; ".join(parts)
