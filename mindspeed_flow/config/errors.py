"""The config package's exception."""

from __future__ import annotations

from ..errors import FlowError


class FlagError(FlowError, ValueError):
    """Flags that contradict each other, or that would make the job train silently wrong:
    start-up refuses them, naming the flags."""
