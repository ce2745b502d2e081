"""The patching package's exceptions: a target that is not what a patch was written
against, two patches that cannot compose, a source or a launch script that cannot be read."""

from __future__ import annotations

from pathlib import Path

from ..errors import FlowError


class PatchError(FlowError, RuntimeError):
    """A target is missing or its signature is not what the patch was written against."""


class PatchConflictError(PatchError):
    """Two features patch one target in ways that cannot compose."""


class SourceMissing(FlowError, LookupError):
    """The module file exists but the qualified name is not defined in it."""


class LaunchScriptError(FlowError, ValueError):
    """The script cannot be read (unbalanced quotes, no training command); names file and line."""

    def __init__(self, path: Path, line: int, reason: str):
        super().__init__(f"{path}:{line}: {reason}")
        self.line, self.reason = line, reason
