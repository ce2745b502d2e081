"""Every exception class of the project derives from :class:`mindspeed_flow.errors.FlowError`
and lives in its package's ``errors`` module (issue 21).

The classes are found by reading the source (every module of ``mindspeed_flow``,
``adapters``, ``patches`` and ``train``), not by importing it, so a module whose optional
dependency is missing here (a pool backend, ``torch_npu``) is walked too; the errors modules
themselves are then imported to check the bases as Python resolves them.
"""

from __future__ import annotations

import ast
import builtins
import importlib
from pathlib import Path

import pytest

from mindspeed_flow.errors import FlowError

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package name it is installed as (setup.cfg's package_dir)
PACKAGES = {"mindspeed_flow": "mindspeed_flow", "adapters": "mindspeed_flow.adapters",
            "patches": "mindspeed_flow.patches", "train": "mindspeed_flow.train"}
BUILTIN_EXCEPTIONS = {name for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, BaseException)}


def _module_name(path: Path) -> str:
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [PACKAGES[folder], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _classes() -> dict[str, list[tuple[str, list[str]]]]:
    """Class name -> every (module, base names) that defines a class of that name."""
    found: dict[str, list[tuple[str, list[str]]]] = {}
    for folder in PACKAGES:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                    found.setdefault(node.name, []).append((_module_name(path), bases))
    return found


def exception_classes() -> list[tuple[str, str, list[str]]]:
    """(module, class, bases) of every class whose bases lead to a builtin exception."""
    classes = _classes()
    exceptions: set[str] = set()
    while True:
        more = {name for name, defs in classes.items() for _, bases in defs
                if any(b in BUILTIN_EXCEPTIONS or b in exceptions for b in bases)} - exceptions
        if not more:
            break
        exceptions |= more
    return sorted((module, name, bases) for name in exceptions for module, bases in classes[name])


EXCEPTIONS = exception_classes()


def test_the_walk_finds_the_exceptions_of_every_package():
    packages = {module.split(".")[1] for module, _, _ in EXCEPTIONS if module.count(".")}
    assert {"allocator", "attention", "data", "patching", "pool", "recipes", "runtime", "schedule",
            "system", "adapters", "config", "train"} <= packages
    assert len(EXCEPTIONS) >= 28  # the issue counted 28 classes without a common base


@pytest.mark.parametrize("module, name, bases", EXCEPTIONS, ids=[f"{m}.{n}" for m, n, _ in EXCEPTIONS])
def test_every_exception_derives_from_flow_error_in_an_errors_module(module, name, bases):
    assert module == "mindspeed_flow.errors" or module.endswith(".errors"), (
        f"{module}.{name}: exceptions live in their package's errors module")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, FlowError), f"{module}.{name}({', '.join(bases)}) does not derive from FlowError"


def test_the_old_builtin_bases_still_catch():
    """FlowError is added beside the builtin bases: ``except ValueError`` still catches."""
    from mindspeed_flow.allocator.errors import AllocatorError
    from mindspeed_flow.data.errors import ResumeMismatch
    from mindspeed_flow.patching.errors import SourceMissing
    from mindspeed_flow.pool.errors import PoolTimeout
    from mindspeed_flow.runtime.errors import PeerFailure
    from mindspeed_flow.schedule.errors import ScheduleError

    assert issubclass(AllocatorError, ValueError) and issubclass(ScheduleError, ValueError)
    assert issubclass(ResumeMismatch, ValueError) and issubclass(SourceMissing, LookupError)
    assert issubclass(PoolTimeout, TimeoutError) and issubclass(PeerFailure, RuntimeError)
