"""The command-line flags a MindSpeed-MM training job accepts, read from source.

``pretrain_vlm.py``'s parser is Megatron's ``parse_args`` extended by MindSpeed
(``process_args`` and each feature's ``register_args``), by MindSpeed-MM (``--mm-*`` and
its ``process_args``) and by this plugin (``add_flow_arguments``).  Building that parser
for real means importing ``mindspeed.megatron_adaptor``, which needs ``torch_npu`` and
MindSpeed-MM's dependency pins (``tests/upstream/`` does it with stand-ins in its own
environment); ``doctor --src`` imports nothing of upstream.  So the upstream flags are read
with :mod:`ast` from the ``add_argument`` calls of the files that build that parser
(:data:`FLAG_SOURCES`), like patch targets are; the plugin's own flags come from its real
parser.  Upstream declares every flag as a string literal (every call at the pinned commits), so
nothing is missed by reading instead of running; the set is a superset where a MindSpeed
feature registers its flags only at some optimisation levels.
``tests/upstream/test_launch_example_parse.py`` checks the verdicts against the real parser.
"""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path

# (who declares them, the files under a checkout root, as globs)
FLAG_SOURCES = (
    ("Megatron", ("megatron/training/arguments.py",)),
    ("MindSpeed", ("mindspeed/arguments.py", "mindspeed/features_manager/**/*.py")),
    ("MindSpeed-MM", ("mindspeed_mm/arguments.py", "mindspeed_mm/configs/config.py")),
)
PLUGIN = "mindspeed-flow"
NO_VALUE_ACTIONS = {"store_true", "store_false", "store_const", "count", "help", "version"}


@dataclass(frozen=True)
class FlagDecl:
    """One declaration of a flag: who, where, and how many values it takes (argparse nargs:
    0, 1, ``"?"``, ``"*"``, ``"+"`` or a count)."""

    owner: str
    where: str
    nargs: int | str


def _nargs(call: ast.Call) -> int | str:
    keywords = {k.arg: k.value for k in call.keywords}
    action, nargs = keywords.get("action"), keywords.get("nargs")
    if isinstance(action, ast.Constant) and action.value in NO_VALUE_ACTIONS:
        return 0
    if action is not None and not (isinstance(action, ast.Constant) and action.value in ("store", "append")):
        return "?"  # a custom or unreadable action: its arity is not judged
    if nargs is None:
        return 1
    return nargs.value if isinstance(nargs, ast.Constant) else "?"


def declared_flags(file: Path, owner: str) -> dict[str, list[FlagDecl]]:
    """Every ``*.add_argument("--flag", ...)`` in a file, without executing it."""
    flags: dict[str, list[FlagDecl]] = {}
    tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            for name in names:
                if name.startswith("-"):
                    flags.setdefault(name, []).append(FlagDecl(owner, f"{file}:{node.lineno}", _nargs(node)))
    return flags


def plugin_flags() -> dict[str, list[FlagDecl]]:
    """The plugin's flags, from the very parser extension Megatron's ``parse_args`` gets."""
    from mindspeed_flow.config import add_flow_arguments

    parser = add_flow_arguments(argparse.ArgumentParser(add_help=False))
    return {name: [FlagDecl(PLUGIN, "mindspeed_flow.config.add_flow_arguments",
                            0 if action.nargs == 0 else (action.nargs or 1))]
            for action in parser._actions for name in action.option_strings}


def source_files(roots: list[Path]) -> tuple[dict[str, list[Path]], list[str]]:
    """Each owner's flag files, from the first root that holds them; and the owners with none."""
    found: dict[str, list[Path]] = {}
    for owner, patterns in FLAG_SOURCES:
        for root in roots:
            files = sorted({f for pattern in patterns for f in Path(root).glob(pattern) if f.is_file()})
            if files:
                found[owner] = files
                break
    return found, [owner for owner, _ in FLAG_SOURCES if owner not in found]


def flag_catalogue(files: dict[str, list[Path]]) -> dict[str, list[FlagDecl]]:
    """Flag -> its declarations by every owner's files, plus the plugin's flags."""
    catalogue: dict[str, list[FlagDecl]] = {}
    for owner, paths in files.items():
        for path in paths:
            for name, decls in declared_flags(path, owner).items():
                catalogue.setdefault(name, []).extend(decls)
    for name, decls in plugin_flags().items():
        catalogue.setdefault(name, []).extend(decls)
    return catalogue
