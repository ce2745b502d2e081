"""Errors of the runtime: every one names the rank, the action index and the action."""

from __future__ import annotations

from ..schedule.actions import Action


class ActionFailed(RuntimeError):
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


def where(rank: int, index: int, action: Action) -> str:
    """``r1 #7 B llm.s1 mb3``: the action as a program listing prints it, squeezed."""
    return f"r{rank} #{index} " + " ".join(str(action).split())
