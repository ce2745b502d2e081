"""The process-wide patch registry and config tree, once the plugin is active.

Entry points (the launcher, the zero-edit ``.pth`` hook, ``doctor``) build the registry from
:mod:`mindspeed_flow.patches`, resolve the config tree from the command line and the
environment, and install both here; upstream adapters then read the tree through
:func:`flow_config` (never the flags themselves) and enable features through
:func:`enable_features` without importing the patch declarations.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Iterable

from mindspeed_flow.config import FlowConfig, cross_check
from mindspeed_flow.patching import PatchRegistry

log = logging.getLogger("mindspeed_flow")

CORE_FEATURE = "core"
# Features that swap no upstream function: ``system`` acts when the plugin activates, before
# upstream is imported.  :func:`job_notes` says what it did in this job, and what ``pool``
# (whose patches act only under a decoupled layout) did.
JOB_FEATURES = ("system",)
_registry: PatchRegistry | None = None
_config: FlowConfig | None = None
_reported_unpatched: set[str] = set()

POOL_INERT = (
    "pool: no pool opened (backend {backend} unused): no decoupled layout is configured, so the vision "
    "encoder runs inside the backbone's pipeline stage 0 (co-located, as MindSpeed-MM builds the model) and "
    "its embeddings go straight to the LLM; a pool carries them between encoder ranks of their own and the "
    "backbone under a decoupled layout (--flow-schedule-config with `decoupled:`, or a decoupled "
    "--flow-allocator-plan)")
POOL_OPEN = "pool: backend {backend}, one pool per slice of the decoupled layout ({layout})"


def job_notes(config: FlowConfig, decoupled: str | None = None) -> list[str]:
    """What the features that act without a patch of their own did in this Megatron /
    MindSpeed-MM job, one line each (logged with the job's feature line); ``decoupled``
    describes the decoupled layout the job runs (``None``: none)."""
    notes = []
    if config.enabled("pool"):
        if decoupled:
            notes.append(POOL_OPEN.format(backend=config.pool_backend, layout=decoupled))
        else:
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


def install_config(config: FlowConfig) -> None:
    """The tree the activation resolved; a later activation in the same process (the
    launcher after the ``.pth`` hook) resolves the script's own arguments and replaces it."""
    global _config
    _config = config


def current_config() -> FlowConfig | None:
    return _config


def flow_config(namespace: argparse.Namespace | None = None, where: str = "Megatron's arguments") -> FlowConfig:
    """The job's config tree, what every adapter reads.

    With ``namespace`` (Megatron's ``args``, MindSpeed's: ``where`` names it), the installed
    tree is checked against it (:func:`mindspeed_flow.config.cross_check`: a disagreement is
    a :class:`~mindspeed_flow.config.FlagError` naming the flags).  Without an activation
    (an adapter driven directly: tests, a job that builds its own registry) the tree is
    resolved from ``namespace`` (else ``sys.argv``) over ``MINDSPEED_FLOW_FLAGS``, with the
    same precedence, and not installed.
    """
    if _config is not None:
        return _config if namespace is None else cross_check(_config, namespace, where)
    if namespace is not None:
        return FlowConfig.from_namespace(namespace)
    return FlowConfig.from_argv(sys.argv[1:])


def deactivate() -> None:
    """Undo every patch and forget the registry and the tree (tests, and ``doctor --use-flowtrain``)."""
    global _registry, _config
    if _registry is not None:
        _registry.remove()
    _registry = None
    _config = None


def enable_features(features: Iterable[str]) -> set[str]:
    """Enable ``core`` plus the given features that have patches; returns what was enabled.

    ``system`` has none by design (:data:`JOB_FEATURES`, :func:`job_notes`);
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
