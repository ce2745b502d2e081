"""The project's ``scripts/*.py`` imported as modules by their own names, so a test can call
their functions (and processes they spawn, which import the script by name, find it too)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def import_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as the module ``name`` (``scripts/`` put on ``sys.path`` once)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return importlib.import_module(name)
