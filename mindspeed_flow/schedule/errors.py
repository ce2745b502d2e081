"""The one exception the schedule package raises for a faulty composition or program."""

from __future__ import annotations

from ..errors import FlowError


class ScheduleError(FlowError, ValueError):
    """A composition that cannot be built, or a program that would run wrongly or hang.

    The message always names the fault: the region, or the rank, the action index and
    the microbatch, so a broken schedule can be fixed without a debugger.
    """
