"""The allocator's exceptions, apart from the specs and files that raise them so that
every allocator module (the file readers included) can import them without a cycle."""

from __future__ import annotations

from ..errors import FlowError


class AllocatorError(FlowError, ValueError):
    """A bad spec, profile or plan file, or an instance without any plan."""


class InfeasibleError(AllocatorError):
    """No plan satisfies the constraints; ``reasons`` holds one line per binding constraint."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = reasons
        super().__init__("no feasible plan:\n  " + "\n  ".join(reasons))
