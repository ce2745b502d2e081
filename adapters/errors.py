"""The adapters' exceptions (one module for the sub-packages: each upstream's adapter
raises few): an upstream too old, a conflicting upstream feature, a missing device."""

from __future__ import annotations

from mindspeed_flow.errors import FlowError


class MegatronCoreVersionError(FlowError, RuntimeError):
    """megatron-core is missing, or older than what the plugin was checked against."""


class ScheduleConflict(FlowError, RuntimeError):
    """Another feature swaps the same schedule: the job must not run under the wrong one."""


class TransposeUnsupported(ScheduleConflict):
    """The transposed ViT layout (``vlm: {transpose: true}``) cannot run with this model or
    these arguments (raised when the model is built, or at the first microbatch it cannot take)."""


class DeviceUnavailableError(FlowError, RuntimeError):
    """The requested profiling device (or enough of them, or its torch extension) is missing."""


class CheckpointFormError(FlowError, ValueError):
    """A checkpoint of the other layout (decoupled / co-located) that this rank cannot be
    assembled from: other pipeline stages, a distributed optimizer, a file or its parameter
    names missing."""
