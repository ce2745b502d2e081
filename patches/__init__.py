"""Patch declarations, one module per feature, each with a module-level ``PATCHES`` list.

Importing a feature module declares its patches and changes nothing; the registry built by
:func:`build_registry` applies those of enabled features.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Mapping, Sequence

from mindspeed_flow.adapters.mindspeed_mm.transformers_path import fit_to_entry
from mindspeed_flow.activation import current_registry, enable_features, install_config, install_registry
from mindspeed_flow.config import FlowConfig
from mindspeed_flow.patching import Patch, PatchRegistry

# Feature modules, in the order their patches are listed.  ``system`` has none
# (``activation.JOB_FEATURES``: the job's log says what it did); any other feature whose
# module is not here has no patches yet: its flag is accepted and the activation log says so.
FEATURE_MODULES = ("core", "fused_attn", "conv_matmul", "packing_accounting", "packing_loader", "allocator",
                   "schedule", "pool", "recipes")


def all_patches() -> list[Patch]:
    patches: list[Patch] = []
    for name in FEATURE_MODULES:
        patches.extend(importlib.import_module(f"{__name__}.{name}").PATCHES)
    return patches


def build_registry() -> PatchRegistry:
    return PatchRegistry(all_patches())


def activate(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
             config: FlowConfig | None = None) -> PatchRegistry:
    """Make the plugin active in this process: resolve the config tree from ``argv``
    (default ``sys.argv[1:]``) over the environment (or take the ``config`` already
    resolved), install it and the registry (built once), and enable the features it selects.

    Flags that are refused raise :class:`~mindspeed_flow.config.FlagError` before anything is
    installed (also features the entry script cannot run, asked for by name:
    :func:`~mindspeed_flow.adapters.mindspeed_mm.transformers_path.fit_to_entry`).  Nothing upstream is imported here: patches of modules not imported yet wait for them.
    """
    environ = os.environ if environ is None else environ
    if config is None:
        config = FlowConfig.from_argv(sys.argv[1:] if argv is None else argv, environ)
    # pretrain_transformers.py (MindSpeed-MM's TransformersModel path) runs only some features.
    config = fit_to_entry(config, sys.argv, environ)
    registry = current_registry()
    if registry is None:
        registry = build_registry()
        install_registry(registry)
    install_config(config)
    # ``system`` swaps nothing: it sets the environment and the core binding right here,
    # before upstream (and torch_npu) is imported, so it is not a registry feature; the job's
    # log says what it set (``activation.job_notes``).
    if config.enabled("system"):
        from mindspeed_flow.system.apply import apply_system_settings
        apply_system_settings()
    enable_features(config.features)
    return registry
