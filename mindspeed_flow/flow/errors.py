"""Errors of the flow package: bad sample metadata or pool keys, and groupings that lose or
repeat a sample."""

from __future__ import annotations

from ..errors import FlowError


class SampleError(FlowError, ValueError):
    """Sample metadata or a per-sample pool key that cannot be right (a negative count, an
    image without patches, a key that is not ``flow/step<n>/act|grad/<sample id>``)."""


class EncoderCostError(FlowError, ValueError):
    """An encoder cost that cannot be one: a calibration file that cannot be read or has no
    ``encoder_cost`` mapping, a term that is unknown, not a number or negative, or terms that
    are all 0 (nothing to cut batches by); the message names the file or the place and the key."""


class GroupingError(FlowError, ValueError):
    """A step's grouping that cannot be made (a sample longer than a microbatch, a microbatch
    count the samples cannot fill) or that loses or repeats a sample; the message names it."""


class StreamError(FlowError, RuntimeError):
    """The flow's producer or consumer found a sample's pool entry that cannot be right (its
    metadata is not the sample's, its rows are not its image tokens), an encoder whose output
    does not match its batch, or a step that ended with a sample not taken or a gradient not
    put; the message names the step, the sample and the side."""
