"""The patch registry: declare monkey patches as data, apply them with wrapt, report and undo.

Feature modules in :mod:`mindspeed_flow.patches` declare :class:`Patch` objects;
:class:`PatchRegistry` applies those of enabled features.
"""

from .errors import PatchConflictError, PatchError
from .patch import Patch
from .registry import PatchRegistry
from .status import PatchStatus

__all__ = ["Patch", "PatchRegistry", "PatchStatus", "PatchError", "PatchConflictError"]
