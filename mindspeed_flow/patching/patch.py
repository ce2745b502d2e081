"""A monkey patch as plain data.

Declaring a :class:`Patch` changes nothing; the registry applies it when its feature is
enabled and the target module is (or becomes) imported.  Keeping patches as data lets the
registry report them, check them against an upstream source tree without importing it
(``mindspeed-flow doctor --src``), compose several patches on one target in a defined
order, and undo every one of them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

# A wrapt-style wrapper: ``wrapper(wrapped, instance, args, kwargs)``.
Wrapper = Callable[[Callable[..., Any], Any, tuple, dict], Any]


@dataclass(frozen=True)
class Patch:
    """One swap of an upstream object.

    Attributes:
        feature: the feature that owns the patch (``"core"``, ``"fused_attn"``, ...).
        target: ``"package.module:Qualified.name"``: the module to wait for and the
            attribute path inside it (a function, a class, or a method / class attribute).
        wrapper: a wrapt wrapper ``(wrapped, instance, args, kwargs)`` placed around the
            original; keeps the original's signature and can be removed.
        replacement: an object put in place of the original (a class, say).  A target takes
            at most one replacement; wrappers stack around it.
        params: the parameters the patch relies on, written like a signature without
            defaults, e.g. ``"extra_args_provider, ignore_unknown_args"`` or
            ``"*, forward_step_func, data_iterator, model"``.  ``None`` skips the check.
            The found signature must hold every expected parameter, in the same order and
            of the same kind; parameters the target has in addition are accepted.
        checked: upstream versions this patch was checked against, e.g.
            ``("megatron-core 0.12.3", "megatron-core 0.16.1")``.
        optional: a missing target or a changed signature skips the patch (reported)
            instead of failing at enable time.
        order: wrappers on one target compose in ascending ``(order, feature)``; the first
            is the innermost, next to the original.
        description: one line for ``doctor``: why the target is patched.
        rebind_aliases: also point names that other modules copied with ``from x import
            f`` at the patched object.  Off for a target that other modules must keep
            seeing unpatched (a wrapper meant for one module's view of a shared helper).
    """

    feature: str
    target: str
    wrapper: Wrapper | None = None
    replacement: Any = None
    params: str | None = None
    checked: tuple[str, ...] = ()
    optional: bool = False
    order: int = 0
    description: str = ""
    rebind_aliases: bool = True

    def __post_init__(self) -> None:
        if ":" not in self.target or self.target.count(":") != 1:
            raise ValueError(
                f"Patch target {self.target!r} must be 'package.module:Qualified.name'"
            )
        if (self.wrapper is None) == (self.replacement is None):
            raise ValueError(
                f"Patch {self.feature}:{self.target} needs exactly one of wrapper= or replacement="
            )

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]

    @property
    def key(self) -> str:
        return f"{self.feature}:{self.target}"


def parse_params(text: str) -> list[tuple[str, str]]:
    """``"a, b, *, c, **kw"`` -> ``[("a", "positional"), ("b", "positional"), ("c", "keyword"), ("kw", "var_keyword")]``."""
    out: list[tuple[str, str]] = []
    kind = "positional"
    for raw in (p.strip() for p in text.split(",")):
        if not raw or raw == "/":
            continue
        if raw == "*":
            kind = "keyword"
        elif raw.startswith("**"):
            out.append((raw[2:], "var_keyword"))
        elif raw.startswith("*"):
            out.append((raw[1:], "var_positional"))
            kind = "keyword"
        else:
            out.append((raw.split("=")[0].split(":")[0].strip(), kind))
    return out


def format_params(params: list[tuple[str, str]]) -> str:
    """The inverse of :func:`parse_params`, for messages."""
    parts: list[str] = []
    star_written = False
    for name, kind in params:
        if kind == "keyword" and not star_written:
            parts.append("*")
            star_written = True
        if kind == "var_positional":
            parts.append("*" + name)
            star_written = True
        elif kind == "var_keyword":
            parts.append("**" + name)
        else:
            parts.append(name)
    return "(" + ", ".join(parts) + ")"


def params_of(obj: Any) -> list[tuple[str, str]]:
    """The parameter list of a live callable in :func:`parse_params` form."""
    kinds = {
        inspect.Parameter.POSITIONAL_ONLY: "positional",
        inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
        inspect.Parameter.KEYWORD_ONLY: "keyword",
        inspect.Parameter.VAR_POSITIONAL: "var_positional",
        inspect.Parameter.VAR_KEYWORD: "var_keyword",
    }
    sig = inspect.signature(obj)
    return [(p.name, kinds[p.kind]) for p in sig.parameters.values()]


def params_compatible(expected: list[tuple[str, str]], found: list[tuple[str, str]]) -> bool:
    """Every expected parameter is in ``found``, same kind, same relative order."""
    position = 0
    for item in expected:
        try:
            position = found.index(item, position) + 1
        except ValueError:
            return False
    return True
