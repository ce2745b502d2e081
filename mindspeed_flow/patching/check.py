"""Does a patch's target exist, and does its signature still fit?  Live or from source.

One verdict function (:func:`judge`) serves the registry at enable time, ``doctor`` on an
installed upstream, and ``doctor --src`` on a source checkout, so the three never disagree.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from .errors import SourceMissing
from .patch import Patch, format_params, params_compatible, parse_params
from .resolve import resolve_live, source_params, upstream_version
from .source import find_in_source, installed_roots
from .status import FOUND, MISSING, NOT_INSTALLED, SIGNATURE_CHANGED, PatchStatus


def judge(patch: Patch, found: list[tuple[str, str]] | None) -> tuple[str, str]:
    """``(status, detail)`` for a target that exists and has parameters ``found``."""
    if patch.params is None:
        return FOUND, ""
    expected = parse_params(patch.params)
    if found is None:
        return FOUND, "parameters not readable here; not checked"
    if params_compatible(expected, found):
        return FOUND, ""
    return SIGNATURE_CHANGED, f"expected {format_params(expected)}, found {format_params(found)}"


def _status(patch: Patch, status: str, detail: str, version: str) -> PatchStatus:
    return PatchStatus(patch.feature, patch.target, status, detail, version, patch.optional)


def check_imported(patch: Patch) -> PatchStatus:
    """Check a target whose module is already in ``sys.modules``."""
    module = sys.modules[patch.module]
    version = upstream_version(patch.module)
    try:
        live = resolve_live(module, patch.qualname)
    except AttributeError as err:
        return _status(patch, MISSING, str(err), version)
    status, detail = judge(patch, source_params(live.raw))
    return _status(patch, status, detail, version)


def check_source(patch: Patch, roots: list[Path], version: str) -> PatchStatus:
    """Check a target in source under ``roots`` without importing anything."""
    try:
        hit = find_in_source(patch.module, patch.qualname, roots)
    except SourceMissing as err:
        return _status(patch, MISSING, str(err), version)
    if hit is None:
        return _status(patch, NOT_INSTALLED, f"no module {patch.module} under {', '.join(map(str, roots))}", version)
    status, detail = judge(patch, hit.params)
    where = f"{hit.file}:{hit.lineno}"
    return _status(patch, status, f"{detail}; {where}" if detail else where, version)


def check_installed(patch: Patch) -> PatchStatus:
    """Check against the installed upstream, importing the target module.

    A module that exists but cannot be imported here (MindSpeed without ``torch_npu``, say)
    is checked from its installed source instead, and the detail says so.
    """
    top = patch.module.split(".")[0]
    if patch.module not in sys.modules:
        try:
            importlib.import_module(patch.module)
        except ModuleNotFoundError as err:
            if not installed_roots(top):
                return _status(patch, NOT_INSTALLED, f"no module named {top!r}", "")
            if err.name == patch.module:  # the package is there, the module is gone
                return _status(patch, MISSING, f"no module named {patch.module!r}", upstream_version(top))
            if err.name and patch.module.startswith(err.name + "."):  # a whole sub-package absent
                return _status(patch, NOT_INSTALLED, f"no module named {err.name!r}", upstream_version(top))
            return _static_fallback(patch, top, err)
        except Exception as err:  # upstream import side effects: report, then read the source
            return _static_fallback(patch, top, err)
    return check_imported(patch)


def _static_fallback(patch: Patch, top: str, err: Exception) -> PatchStatus:
    result = check_source(patch, installed_roots(top), upstream_version(top))
    note = f"not importable here ({type(err).__name__}: {err}); read from source"
    detail = f"{note}; {result.detail}" if result.detail else note
    return PatchStatus(result.feature, result.target, result.status, detail, result.version, result.optional)
