"""The attention package's exceptions."""

from __future__ import annotations

from ..errors import FlowError


class ConvNotReplaceable(FlowError, ValueError):
    """The convolution is not a patch embedding: a matmul would compute something else."""
