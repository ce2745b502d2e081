"""Errors of the runtime: an action that failed names the rank, the action index and the
action; a wait that ended without its message says why."""

from __future__ import annotations

from ..errors import FlowError
from ..schedule.actions import Action


class ActionFailed(FlowError, RuntimeError):
    """An action of a rank's program failed, or could not finish because another rank's did.

    ``where`` is ``r<rank> #<index> <action>`` of the action this rank was running; the
    message also names the first failure of the step (``r1 #7 B llm.s1 mb3: ValueError``)
    when another rank reported it.
    """

    def __init__(self, rank: int, index: int, action: Action, reason: str) -> None:
        self.rank = rank
        self.index = index
        self.action = action
        self.reason = reason
        super().__init__(f"{where(rank, index, action)}: {reason}")


class PeerFailure(FlowError, RuntimeError):
    """A wait ended without its message: the reason says why (a rank's report, a closed
    connection, the timeout)."""


def where(rank: int, index: int, action: Action) -> str:
    """``r1 #7 B llm.s1 mb3``: the action as a program listing prints it, squeezed."""
    return f"r{rank} #{index} " + " ".join(str(action).split())
