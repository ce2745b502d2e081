"""Apply declared patches with wrapt, rebind copied names, report, and undo.

Life of a target (``module:qualname``):

1. ``enable(features)`` marks the features' patches enabled.  A target whose module is
   already imported is checked and swapped at once; for any other, the source is checked
   now (found through ``sys.path`` without importing it) and a
   ``wrapt.register_post_import_hook`` swaps it the moment the module is imported.  When
   the upstream package is not on ``sys.path`` yet (the ``.pth`` hook runs before Python
   puts the script's folder there, and MindSpeed-MM keeps Megatron beside its script), the
   source check waits for the import of the package's top level and runs then, before any
   target module is imported; until then the report says so.
2. Swapping builds one chain per target: the original (or the single ``replacement``), then
   each wrapper in ascending ``(order, feature)``, innermost first.  Enabling another
   feature on an applied target rebuilds the chain from the original, so applying is
   idempotent and never double-wraps.
3. After a swap, every module in ``sys.modules`` that holds the original under some name
   (``from x import f``, ``__main__`` included) is pointed at the new object.
4. ``remove()`` puts back the original object, and every module-level name bound to the
   patched object (rebound aliases, and copies taken after the swap) points at it again.
   When another patcher wrapped ours in the meantime (MindSpeed's patch manager wraps
   ``getattr(cls, name)``, which for our wrapper is a wrapt ``BoundFunctionWrapper``), its
   wrapper stays and ours is unlinked from under it: the chain becomes what it would be
   had we never patched.

A target that is missing or whose parameters changed raises :class:`PatchError` naming the
target, the expected and found signature and the upstream version, unless the patch is
optional: then it is skipped and the report says why.
"""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from types import ModuleType
from dataclasses import dataclass, field
from typing import Any, Iterable

import wrapt

from .check import check_imported, check_source
from .patch import Patch
from .resolve import LiveTarget, resolve_live, upstream_version
from .source import installed_roots
from .status import (
    APPLIED,
    DECLARED,
    FOUND,
    NOT_INSTALLED,
    PENDING,
    SKIPPED,
    PatchConflictError,
    PatchError,
    PatchStatus,
)


@dataclass
class _Applied:
    """What one swapped target needs for undo."""

    live: LiveTarget
    patched: Any
    patches: list[Patch]
    aliases: list[tuple[Any, str]] = field(default_factory=list)


class PatchRegistry:
    """Holds declared patches; applies those of enabled features."""

    def __init__(self, patches: Iterable[Patch]):
        self._patches: list[Patch] = list(patches)
        keys = [p.key for p in self._patches]
        duplicates = sorted({k for k in keys if keys.count(k) > 1})
        if duplicates:
            raise PatchConflictError(f"patches declared twice: {', '.join(duplicates)}")
        self._enabled: set[str] = set()
        self._applied: dict[str, _Applied] = {}
        self._skipped: dict[str, PatchStatus] = {}
        self._hooked_modules: set[str] = set()
        # Source checks waiting for their top-level package to become importable.
        self._unchecked: dict[str, list[Patch]] = defaultdict(list)
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ queries
    @property
    def patches(self) -> list[Patch]:
        return list(self._patches)

    @property
    def features(self) -> list[str]:
        return sorted({p.feature for p in self._patches})

    @property
    def enabled(self) -> set[str]:
        return set(self._enabled)

    def _by_target(self) -> dict[str, list[Patch]]:
        groups: dict[str, list[Patch]] = defaultdict(list)
        for patch in self._patches:
            if patch.feature in self._enabled and patch.key not in self._skipped:
                groups[patch.target].append(patch)
        return groups

    def report(self) -> list[PatchStatus]:
        """One status per declared patch: declared, pending, applied or skipped."""
        rows = []
        for patch in self._patches:
            if patch.key in self._skipped:
                rows.append(self._skipped[patch.key])
                continue
            if patch.feature not in self._enabled:
                status = DECLARED
            elif patch.target in self._applied:
                status = APPLIED
            else:
                status = PENDING
            where = ""
            if status == APPLIED:
                where = f"{len(self._applied[patch.target].aliases)} alias(es) rebound"
            elif status == PENDING:
                where = f"waiting for import of {patch.module}"
                top = patch.module.split(".")[0]
                if patch in self._unchecked.get(top, ()):
                    where += (f"; source not checked yet: {top!r} was not on sys.path at activation "
                              f"(checked when {top} is imported)")
            version = upstream_version(patch.module) if patch.module in sys.modules else ""
            rows.append(PatchStatus(patch.feature, patch.target, status, where, version, patch.optional))
        return rows

    # ------------------------------------------------------------------ enable / remove
    def enable(self, features: Iterable[str]) -> None:
        """Enable features: apply their patches now or when their modules are imported."""
        features = set(features)
        unknown = features - set(self.features)
        if unknown:
            raise ValueError(
                f"unknown feature(s) {sorted(unknown)}; declared features: {self.features}"
            )
        with self._lock:
            self._enabled |= features
            groups = self._by_target()
            touched = [t for t, ps in groups.items() if any(p.feature in features for p in ps)]
            for target in touched:
                _single_replacement(groups[target])  # a conflict fails now, not at import
                patch = groups[target][0]
                if patch.module in sys.modules:
                    self._apply_target(target)
                else:
                    for p in groups[target]:
                        self._precheck_source(p)
                    self._hook(patch.module)
            self._rebind_aliases(touched)

    def remove(self) -> None:
        """Undo every applied patch and rebound alias; disable every feature."""
        with self._lock:
            for target in list(self._applied):
                self._restore_target(target)
            self._enabled.clear()
            self._skipped.clear()
            self._unchecked.clear()

    def refresh(self) -> list[str]:
        """Re-apply patches that another patcher replaced after us; returns their targets.

        MindSpeed's patch manager sets attributes directly, so a MindSpeed patch applied
        after ours on the same target silently drops our wrapper.  A target whose current
        object still reaches ours through ``__wrapped__`` (a foreign wrapper around ours) is
        left alone; otherwise the foreign object becomes what we wrap, and ``remove()``
        puts that object back.
        """
        with self._lock:
            lost = []
            for target, applied in list(self._applied.items()):
                live = applied.live
                current = vars(live.parent).get(live.attr)  # a module or a class: its own namespace
                if _reaches(current, applied.patched):
                    continue
                del self._applied[target]  # forget, do not restore: the foreign object stays
                self._apply_target(target)
                lost.append(target)
            self._rebind_aliases(lost)
            return lost

    # ------------------------------------------------------------------ internals
    def _hook(self, module_name: str) -> None:
        if module_name in self._hooked_modules:
            return
        self._hooked_modules.add(module_name)
        # wrapt has no unregister: the hook stays and does nothing once features are disabled.
        wrapt.register_post_import_hook(self._on_import, module_name)

    def _hook_top(self, top: str) -> None:
        key = f"top:{top}"
        if key not in self._hooked_modules:
            self._hooked_modules.add(key)
            wrapt.register_post_import_hook(self._on_top_import, top)

    def _on_top_import(self, package: Any) -> None:
        """The deferred source checks of one upstream package, now that it is importable."""
        with self._lock:
            waiting = self._unchecked.pop(package.__name__, [])
            groups = self._by_target()
            for patch in waiting:
                if patch in groups.get(patch.target, ()) and patch.target not in self._applied \
                        and patch.module not in sys.modules:
                    self._precheck_source(patch)

    def _on_import(self, module: Any) -> None:
        with self._lock:
            targets = [t for t, ps in self._by_target().items() if ps[0].module == module.__name__]
            for target in targets:
                self._apply_target(target)
            self._rebind_aliases(targets)

    def _precheck_source(self, patch: Patch) -> None:
        """Before the module is imported, check what its source on ``sys.path`` says."""
        top = patch.module.split(".")[0]
        roots = installed_roots(top)
        if not roots:  # not importable yet (or not installed): check when the package is imported
            if patch not in self._unchecked[top]:
                self._unchecked[top].append(patch)
            if top != patch.module:
                self._hook_top(top)
            return
        result = check_source(patch, roots, upstream_version(patch.module))
        if result.status != NOT_INSTALLED:  # a package without that module: wait and see
            self._accept_or_fail(patch, result)

    def _accept_or_fail(self, patch: Patch, result: PatchStatus) -> bool:
        if result.status == FOUND:
            return True
        if patch.optional:
            self._skipped[patch.key] = PatchStatus(
                patch.feature, patch.target, SKIPPED, f"{result.status}: {result.detail}",
                result.version, optional=True,
            )
            return False
        raise PatchError(
            f"cannot patch {patch.target} for feature {patch.feature!r}: target {result.status} "
            f"({result.detail}); upstream {result.version or 'unknown'}; "
            f"patch checked against {', '.join(patch.checked) or 'nothing recorded'}"
        )

    def _apply_target(self, target: str) -> None:
        if target in self._applied:
            self._restore_target(target)
        patches = [p for p in self._by_target().get(target, []) if self._accept_or_fail(p, check_imported(p))]
        if not patches:
            return
        live = resolve_live(sys.modules[patches[0].module], patches[0].qualname)
        patched = _compose(live.raw, patches)
        setattr(live.parent, live.attr, patched)
        self._applied[target] = _Applied(live, patched, patches)

    def _restore_target(self, target: str) -> None:
        applied = self._applied.pop(target)
        live = applied.live
        current = vars(live.parent).get(live.attr)
        if current is not applied.patched and _reaches(current, applied.patched) \
                and _unlink(current, applied.patched, _as_seen_by_getattr(live)):
            pass  # a foreign wrapper around ours stays; ours is gone from under it
        elif live.own:
            setattr(live.parent, live.attr, live.raw)
        else:
            delattr(live.parent, live.attr)
        if isinstance(live.parent, ModuleType):
            # Aliases we rebound, and copies made after the swap (a package re-export that
            # imported the patched name), all go back to the original.
            _swap_module_references({id(applied.patched): (applied.patched, live.raw)}, skip=())

    def _rebind_aliases(self, targets: Iterable[str]) -> None:
        """Point names copied with ``from x import f`` at the patched object (one scan)."""
        swaps = {}
        owners = []
        for target in targets:
            applied = self._applied.get(target)
            if applied is None or not isinstance(applied.live.parent, ModuleType):
                continue  # class attributes are reached through the class: no aliases
            if all(p.rebind_aliases for p in applied.patches):
                swaps[id(applied.live.raw)] = (applied.live.raw, applied.patched)
                owners.append((applied.live.parent, applied.live.attr))
        if not swaps:
            return
        rebound = _swap_module_references(swaps, skip=owners)
        for target in targets:
            applied = self._applied.get(target)
            if applied is not None:
                applied.aliases += [(m, n) for m, n, new in rebound if new is applied.patched]


def _swap_module_references(swaps: dict[int, tuple[Any, Any]], skip) -> list[tuple[ModuleType, str, Any]]:
    """In every loaded module, replace each name bound to an ``old`` object by its ``new`` one.

    ``swaps`` maps ``id(old)`` to ``(old, new)``; ``skip`` lists ``(module, name)`` pairs to
    leave alone.  Returns ``(module, name, new)`` for each name changed.
    """
    changed = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            pair = swaps.get(id(value))
            if pair is None or value is not pair[0] or (module, name) in skip:
                continue
            setattr(module, name, pair[1])
            changed.append((module, name, pair[1]))
    return changed


def _is_ours(obj: Any, ours: Any) -> bool:
    """``obj`` is our wrapper, or the wrapt ``BoundFunctionWrapper`` that reading it from its
    class (``getattr(cls, name)``, as MindSpeed's patch manager does) creates each time."""
    if obj is ours:
        return True
    return isinstance(obj, wrapt.BoundFunctionWrapper) and obj._self_parent is ours


def _reaches(obj: Any, wanted: Any, max_depth: int = 64) -> bool:
    """Whether ``wanted`` (or a bound form of it) is ``obj`` or lies along its ``__wrapped__`` chain."""
    for _ in range(max_depth):
        if _is_ours(obj, wanted):
            return True
        obj = getattr(obj, "__func__", obj)  # a staticmethod / classmethod around a wrapper
        if _is_ours(obj, wanted):
            return True
        obj = getattr(obj, "__wrapped__", None)
        if obj is None:
            return False
    return False


def _as_seen_by_getattr(live: LiveTarget) -> Any:
    """What ``getattr(parent, attr)`` gave for the original: a foreign wrapper holds that."""
    raw = live.raw
    if isinstance(live.parent, type) and hasattr(raw, "__get__"):
        return raw.__get__(None, live.parent)
    return raw


def _unlink(foreign: Any, ours: Any, original: Any, max_depth: int = 64) -> bool:
    """Make the layer of ``foreign``'s chain that wraps ``ours`` wrap ``original`` instead.

    A ``functools.wraps`` wrapper holds what it wraps in a closure cell and in
    ``__wrapped__``; a wrapt wrapper in ``__wrapped__``.  Both are repointed.  Returns False
    (nothing changed) when the layer keeps its reference somewhere else.
    """
    layer = foreign
    for _ in range(max_depth):
        inner = getattr(layer, "__wrapped__", None)
        if inner is None:
            return False
        if _is_ours(inner, ours):
            cells = [c for c in (getattr(layer, "__closure__", None) or ()) if _is_ours(_cell_value(c), ours)]
            if not cells and not isinstance(layer, wrapt.ObjectProxy):
                return False
            for cell in cells:
                cell.cell_contents = original
            layer.__wrapped__ = original
            return True
        layer = inner
    return False


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _single_replacement(patches: list[Patch]) -> Patch | None:
    """The one replacement among a target's patches; two cannot compose."""
    replacements = [p for p in patches if p.replacement is not None]
    if len(replacements) > 1:
        names = " and ".join(f"{p.feature!r}" for p in replacements)
        raise PatchConflictError(
            f"features {names} both replace {patches[0].target}; a target takes one replacement"
        )
    return replacements[0] if replacements else None


def _compose(original: Any, patches: list[Patch]) -> Any:
    """The chain for one target: original or replacement, then wrappers, innermost first."""
    replacement = _single_replacement(patches)
    obj = replacement.replacement if replacement is not None else original
    wrappers = sorted((p for p in patches if p.wrapper is not None), key=lambda p: (p.order, p.feature))
    for patch in wrappers:
        obj = wrapt.FunctionWrapper(obj, patch.wrapper)
    return obj
