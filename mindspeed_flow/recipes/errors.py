"""The recipes' exceptions: each message names the flag, entry or input at fault."""

from __future__ import annotations

from ..errors import FlowError


class RecipeConfigError(FlowError, ValueError):
    """A recipe flag's value is malformed; the message names the flag and the entry."""


class AveragingError(FlowError, ValueError):
    """Inputs that cannot be averaged; the message names the input and the first difference."""
