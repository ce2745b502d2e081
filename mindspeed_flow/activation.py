"""The process-wide patch registry, once the plugin is active.

Entry points (the launcher, the zero-edit ``.pth`` hook, ``doctor``) build the registry from
:mod:`mindspeed_flow.patches` and install it here; upstream adapters (MindSpeed's feature
hook, say) then enable features through :func:`enable_features` without importing the
patch declarations themselves.
"""

from __future__ import annotations

import logging
from typing import Iterable

from typing import TYPE_CHECKING

from mindspeed_flow.patching import PatchRegistry

if TYPE_CHECKING:
    from mindspeed_flow.config import FlowConfig

log = logging.getLogger("mindspeed_flow")

CORE_FEATURE = "core"
# Features that swap no upstream function: ``system`` acts when the plugin activates, before
# upstream is imported; ``pool`` carries embeddings only between an encoder and a backbone on
# devices of their own.  :func:`job_notes` says what each did in this job.
JOB_FEATURES = ("pool", "system")
_registry: PatchRegistry | None = None
_reported_unpatched: set[str] = set()

POOL_INERT = (
    "pool: inert in this job, no pool opened (backend {backend} unused): the vision encoder runs inside "
    "the backbone's pipeline stage 0 (co-located, as MindSpeed-MM builds the model), so its embeddings "
    "go straight to the LLM; a pool carries them only between an encoder and a backbone on devices of "
    "their own (the decoupled layout of `mindspeed-flow train`), which this version does not run in a "
    "Megatron / MindSpeed-MM job")


def job_notes(config: "FlowConfig") -> list[str]:
    """What the features that swap nothing did in this Megatron / MindSpeed-MM job, one
    line each (logged with the job's feature line)."""
    notes = []
    if config.enabled("pool"):
        notes.append(POOL_INERT.format(backend=config.pool_backend))
    if config.enabled("system"):
        from mindspeed_flow.system.apply import applied_settings

        applied = applied_settings()
        if applied is None:
            notes.append("system: nothing set in this process (it acts when the plugin activates, before "
                         "upstream is imported, and this process activated it without --flow-system)")
        else:
            env, binding = applied
            set_here = ", ".join(s.describe() for s in env) if env else "none (torch_npu is not installed)"
            notes.append(f"system: bound {binding.describe()}, each local rank to its own share; "
                         f"Ascend environment defaults: {set_here}")
    return notes


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

    ``pool`` and ``system`` have none by design (:data:`JOB_FEATURES`, :func:`job_notes`);
    any other feature without patches is accepted and logged, never silently.
    """
    if _registry is None:
        raise RuntimeError(
            "mindspeed-flow is not active: start the job with `python -m mindspeed_flow.launch "
            "SCRIPT ARGS`, or pass --use-flowtrain / set MINDSPEED_FLOW_FLAGS"
        )
    wanted = set(features)
    declared = set(_registry.features)
    for name in sorted(wanted - declared - set(JOB_FEATURES) - _reported_unpatched):
        _reported_unpatched.add(name)
        log.warning("mindspeed-flow: feature %r has no patches in this version; flag accepted, nothing swapped", name)
    enabled = ({CORE_FEATURE} | wanted) & declared
    _registry.enable(enabled)
    return enabled
