"""Megatron's namespace against the tree resolved at activation.

Megatron (and MindSpeed's feature manager) parse the same command line again, with our flags
registered in their parsers; their ``args`` must say what the tree says.  They can only
disagree when the command line changed between the plugin's activation and upstream's parse
(a script that rewrites ``sys.argv``, a parse of another list): the job would then run some
features on one reading and some on the other, so start-up refuses it, naming each flag
with both values.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from .flags import ENV_VAR, MASTER_DEST
from .tree import OPTIONS, FlagError, FlowConfig, resolve


def config_items(config: FlowConfig) -> dict[str, Any]:
    """The tree as ``{label: value}``: ``features`` and each option under its flag."""
    items: dict[str, Any] = {"features": ", ".join(sorted(config.features)) or "none"}
    for name in OPTIONS:
        branch = getattr(config, name)
        for f in fields(branch):
            items[f.metadata["flag"]] = getattr(branch, f.name)
    return items


def cross_check(config: FlowConfig, namespace: argparse.Namespace, where: str = "Megatron's arguments") -> FlowConfig:
    """``config`` when ``namespace`` agrees with it; a namespace without our flags registered
    (a parser that never saw them) has nothing to check.  Raises :class:`FlagError` otherwise."""
    if not hasattr(namespace, MASTER_DEST):
        return config
    seen = resolve(namespace, config.environment).without(config.withheld)
    if seen == config:
        return config
    ours, theirs = config_items(config), config_items(seen)
    differences = [f"{label}: {theirs[label]!r} in {where}, {ours[label]!r} at activation"
                   for label in ours if ours[label] != theirs[label]]
    raise FlagError(f"{where} disagree with the flags the plugin was activated with (the command line over "
                    f"{ENV_VAR}): {'; '.join(differences)}; the command line changed after start-up (was "
                    "sys.argv rewritten?)")
