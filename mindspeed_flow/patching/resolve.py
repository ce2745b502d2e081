"""Finding a patch target in a live, imported module, and naming the upstream it came from.

The parameters checked are those of the object *as written in the source*: a method keeps
``self``, a classmethod keeps ``cls``, a class is checked through its ``__init__``.  The
static checker in :mod:`.source` reads the same thing from the AST, so a patch has one
``params`` string that holds for both.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from .patch import params_of


@dataclass
class LiveTarget:
    """Where a target lives: ``setattr(parent, attr, ...)`` swaps it.

    ``own`` is false when a class inherits the attribute from a base class; undo then
    deletes the attribute from the class again instead of setting it.
    """

    parent: Any
    attr: str
    raw: Any
    own: bool


def resolve_live(module: ModuleType, qualname: str) -> LiveTarget:
    """Walk ``qualname`` inside ``module``; raises ``AttributeError`` naming the missing part."""
    *path, attr = qualname.split(".")
    parent: Any = module
    walked = module.__name__
    for part in path:
        if not hasattr(parent, part):
            raise AttributeError(f"{walked} has no attribute {part!r}")
        parent = getattr(parent, part)
        walked += "." + part
    if isinstance(parent, type):
        for klass in parent.__mro__:
            if attr in vars(klass):
                return LiveTarget(parent, attr, vars(klass)[attr], own=klass is parent)
        raise AttributeError(f"class {walked} has no attribute {attr!r}")
    if not hasattr(parent, attr):
        raise AttributeError(f"{walked} has no attribute {attr!r}")
    return LiveTarget(parent, attr, getattr(parent, attr), own=True)


def source_params(raw: Any) -> list[tuple[str, str]] | None:
    """Parameters of ``raw`` as written in its source, or None when it is not callable."""
    func = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    if isinstance(func, type):
        func = func.__init__
    if not callable(func):
        return None
    try:
        return params_of(func)
    except (TypeError, ValueError):
        return None


@functools.lru_cache(maxsize=1)
def _distributions_by_package() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def upstream_version(module_name: str) -> str:
    """``"megatron-core 0.12.3"``; a package with no metadata is named a source copy."""
    top = module_name.split(".")[0]
    for dist in _distributions_by_package().get(top, []):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    version = getattr(sys.modules.get(top), "__version__", None)
    return f"{top} {version}" if version else f"{top} (source copy, no version metadata)"
