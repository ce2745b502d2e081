"""The system package's exceptions: sysfs files and tools' answers that do not parse."""

from __future__ import annotations

from ..errors import FlowError


class BusIdError(FlowError, ValueError):
    """A bus id or a tool's answer that does not parse; the message names where it came from."""


class TopologyError(FlowError, ValueError):
    """A sysfs file that does not parse; the message names it."""
