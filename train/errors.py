"""The main job's exceptions: a config, a record or a checkpoint that the job cannot use
(a rank that fails is :class:`mindspeed_flow.errors.RankFailed`, the launcher's)."""

from __future__ import annotations

from mindspeed_flow.errors import FlowError


class ConfigError(FlowError, ValueError):
    """A config file that cannot be used; the message names the file and the key."""


class MetricsError(FlowError, ValueError):
    """A record holds a value no measurement can produce (negative time, unknown kind, ...)."""


class CheckpointMismatch(FlowError, ValueError):
    """A checkpoint written by another run or layout than the trainer loading it."""
