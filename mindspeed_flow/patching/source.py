"""Checking patch targets in upstream *source* without importing it.

MindSpeed and MindSpeed-MM are not pip-installable and cannot be imported on a machine
without an NPU, yet their targets must be checked.  So ``doctor --src DIR`` (and the
registry, for modules not imported yet) reads the module file with :mod:`ast`: it finds
top-level and class-level definitions, follows ``from x import name`` re-exports a few
levels, and reads parameter lists from ``def`` lines.  Nothing in the tree is executed.
"""

from __future__ import annotations

import ast
import importlib.machinery
from dataclasses import dataclass
from pathlib import Path

from .errors import SourceMissing

MAX_REEXPORT_DEPTH = 5


@dataclass(frozen=True)
class SourceHit:
    """A definition found in source; ``params`` is None where the source cannot tell."""

    file: Path
    lineno: int
    params: list[tuple[str, str]] | None


def module_file(module_name: str, roots: list[Path]) -> Path | None:
    """``a.b.c`` -> ``ROOT/a/b/c.py`` or ``ROOT/a/b/c/__init__.py`` under the first root that has it."""
    parts = module_name.split(".")
    for root in roots:
        base = Path(root).joinpath(*parts)
        if (base / "__init__.py").is_file():
            return base / "__init__.py"
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py")
    return None


def installed_roots(top_package: str) -> list[Path]:
    """Folders that hold the top-level package or module on ``sys.path``, found without importing it."""
    spec = importlib.machinery.PathFinder.find_spec(top_package)
    if spec is None:
        return []
    if spec.submodule_search_locations:  # a package, or a namespace spread over folders
        return [Path(location).parent for location in spec.submodule_search_locations]
    return [Path(spec.origin).parent] if spec.origin else []  # a single-file module


def _args_params(args: ast.arguments) -> list[tuple[str, str]]:
    params = [(a.arg, "positional") for a in args.posonlyargs + args.args]
    if args.vararg is not None:
        params.append((args.vararg.arg, "var_positional"))
    params += [(a.arg, "keyword") for a in args.kwonlyargs]
    if args.kwarg is not None:
        params.append((args.kwarg.arg, "var_keyword"))
    return params


def _statements(body: list[ast.stmt]):
    """Statements of a body, descending into ``if`` / ``try`` blocks (conditional definitions)."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _statements(node.body)
            yield from _statements(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody):
                yield from _statements(block)
            for handler in node.handlers:
                yield from _statements(handler.body)


def _binds(node: ast.stmt, name: str) -> bool:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == name
    return False


def _definition(body: list[ast.stmt], name: str) -> ast.stmt | None:
    """The last statement that binds ``name`` (a later definition wins, as at run time)."""
    found = None
    for node in _statements(body):
        if _binds(node, name):
            found = node
    return found


def _import_source(tree: ast.Module, module_name: str, is_package: bool, name: str) -> tuple[str, str, int] | None:
    """``(source module, original name, line)`` when the module binds ``name`` by ``from x import``."""
    for node in _statements(tree.body):
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            if node.level:
                package = module_name if is_package else module_name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                source = package + ("." + node.module if node.module else "")
            else:
                source = node.module or ""
            return source, alias.name, node.lineno
    return None


def _params_of_definition(node: ast.stmt) -> list[tuple[str, str]] | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return _args_params(node.args)
    if isinstance(node, ast.ClassDef):
        init = _definition(node.body, "__init__")
        if isinstance(init, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return _args_params(init.args)
    return None


def find_in_source(module_name: str, qualname: str, roots: list[Path], _depth: int = 0) -> SourceHit | None:
    """Locate ``module_name:qualname`` under ``roots``.

    Returns None when the module file is not there at all; raises :class:`SourceMissing`
    naming the file when the module exists but does not define the name.
    """
    path = module_file(module_name, roots)
    if path is None:
        return None
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    parts = qualname.split(".")
    body = tree.body
    node: ast.stmt | None = None
    for index, part in enumerate(parts):
        node = _definition(body, part)
        if node is None and index == 0 and _depth < MAX_REEXPORT_DEPTH:
            origin = _import_source(tree, module_name, path.name == "__init__.py", part)
            if origin is not None:
                rest = ".".join([origin[1]] + parts[1:])
                hit = find_in_source(origin[0], rest, roots, _depth + 1)
                # Imported from outside the roots (torch, say): bound, but not readable here.
                return hit if hit is not None else SourceHit(path, origin[2], None)
        if node is None:
            raise SourceMissing(f"{'.'.join(parts[: index + 1])} is not defined in {path}")
        if index < len(parts) - 1:
            if not isinstance(node, ast.ClassDef):
                raise SourceMissing(f"{'.'.join(parts[: index + 1])} in {path} is not a class")
            body = node.body
    return SourceHit(path, node.lineno, _params_of_definition(node))
