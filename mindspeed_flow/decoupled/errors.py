"""The decoupled layout's refusals (a size below one, a rank outside the world, a world that
is not the layout's, a plan or file that no decoupled layout runs)."""

from __future__ import annotations

from ..errors import FlowError


class LayoutError(FlowError, ValueError):
    """A decoupled layout that cannot be built or cannot run here; the message names the
    sizes (and the file or plan they came from)."""
