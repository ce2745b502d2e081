"""The process-wide patch registry, once the plugin is active.

Entry points (the launcher, the zero-edit ``.pth`` hook, ``doctor``) build the registry from
:mod:`mindspeed_flow.patches` and install it here; upstream adapters (MindSpeed's feature
hook, say) then enable features through :func:`enable_features` without importing the
patch declarations themselves.
"""

from __future__ import annotations

import logging
from typing import Iterable

from mindspeed_flow.patching import PatchRegistry

log = logging.getLogger("mindspeed_flow")

CORE_FEATURE = "core"
_registry: PatchRegistry | None = None
_reported_unpatched: set[str] = set()


def install_registry(registry: PatchRegistry) -> None:
    global _registry
    if _registry is not None and _registry is not registry:
        raise RuntimeError("mindspeed-flow is already active with another patch registry")
    _registry = registry


def current_registry() -> PatchRegistry | None:
    return _registry


def deactivate() -> None:
    """Undo every patch and forget the registry (tests, and ``doctor --use-flowtrain``)."""
    global _registry
    if _registry is not None:
        _registry.remove()
    _registry = None


def enable_features(features: Iterable[str]) -> set[str]:
    """Enable ``core`` plus the given features that have patches; returns what was enabled.

    A feature whose patches are not written yet is accepted and logged, never silently.
    """
    if _registry is None:
        raise RuntimeError(
            "mindspeed-flow is not active: start the job with `python -m mindspeed_flow.launch "
            "SCRIPT ARGS`, or pass --use-flowtrain / set MINDSPEED_FLOW_FLAGS"
        )
    wanted = set(features)
    declared = set(_registry.features)
    for name in sorted(wanted - declared - _reported_unpatched):
        _reported_unpatched.add(name)
        log.warning("mindspeed-flow: feature %r has no patches in this version; flag accepted, nothing swapped", name)
    enabled = ({CORE_FEATURE} | wanted) & declared
    _registry.enable(enabled)
    return enabled
