"""The plugin's flags: ``--use-flowtrain``, one ``--flow-X`` / ``--no-flow-X`` per feature,
the options of the features, and ``MINDSPEED_FLOW_FLAGS``.

Jobs whose command line cannot change put the same flags in ``MINDSPEED_FLOW_FLAGS`` (e.g.
``MINDSPEED_FLOW_FLAGS="--use-flowtrain --no-flow-allocator"``).  What they resolve to is
:mod:`.tree`'s business; this module only declares and parses them.

The flags are added to upstream's own parser (Megatron's ``parse_args`` through its
``extra_args_provider``, MindSpeed's feature manager), so ``add_flow_arguments`` is
idempotent: whichever path comes second finds them registered and adds nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass
from typing import Mapping, Sequence

from mindspeed_flow.recipes.flags import add_recipe_arguments

from .options import DEFAULT_POOL_BACKEND_RULE, POOL_BACKENDS, flag_dest

ENV_VAR = "MINDSPEED_FLOW_FLAGS"
MASTER_FLAG = "--use-flowtrain"
MASTER_DEST = flag_dest(MASTER_FLAG)


@dataclass(frozen=True)
class FeatureSpec:
    """A switchable feature: its registry name and the flag that turns it on."""

    name: str
    flag: str
    help: str

    @property
    def dest(self) -> str:
        return flag_dest(self.flag)


FEATURES: tuple[FeatureSpec, ...] = (
    FeatureSpec("packing", "--flow-packing", "distributed online-packing data loader"),
    FeatureSpec("schedule", "--flow-schedule", "decoupled encoder/backbone pipeline schedule"),
    FeatureSpec("pool", "--flow-pool", "unified memory pool between encoder and backbone "
                "(backend from --flow-pool-backend)"),
    FeatureSpec("allocator", "--flow-allocator", "heterogeneous parallel-configuration allocator (HiGHS)"),
    FeatureSpec("fused_attn", "--flow-fused-attn", "fused varlen attention, no dense masks for packed batches"),
    FeatureSpec("conv_matmul", "--flow-conv-matmul", "ViT patch embedding Conv -> Matmul"),
    FeatureSpec("recipes", "--flow-recipes", "convergence recipes (per-module LR); each acts only when its "
                "value is given (--flow-module-lr ...)"),
    FeatureSpec("system", "--flow-system", "NUMA-aware core binding per local rank and Ascend environment "
                "defaults (never overriding a set variable)"),
)
FEATURE_NAMES = tuple(f.name for f in FEATURES)


def add_flow_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the mindspeed-flow flags to ``parser`` (once); returns it, like Megatron's providers."""
    if MASTER_FLAG in parser._option_string_actions:
        return parser
    group = parser.add_argument_group(title="mindspeed-flow")
    group.add_argument(MASTER_FLAG, action="store_true", default=None,
                       help="enable every mindspeed-flow feature (each can be turned off with --no-flow-X)")
    for spec in FEATURES:
        group.add_argument(spec.flag, dest=spec.dest, action=argparse.BooleanOptionalAction,
                           default=None, help=f"{spec.help} (default: on under {MASTER_FLAG})")
    group.add_argument("--flow-pool-backend", choices=POOL_BACKENDS, default=None,
                       help=f"memory pool backend; implies --flow-pool (default: {DEFAULT_POOL_BACKEND_RULE})")
    group.add_argument("--flow-allocator-plan", default=None, metavar="PLAN",
                       help="plan file (mindspeed-flow plan CONFIG --out PLAN) that --flow-allocator applies")
    group.add_argument("--flow-schedule-config", default=None, metavar="PATH",
                       help="YAML schedule layout (regions, skeletons, trainable bits, in-flight limits) that "
                            "--flow-schedule runs (default: Megatron's own 1F1B / interleaved layout)")
    add_recipe_arguments(group)
    return parser


def _flow_parser() -> argparse.ArgumentParser:
    # Built like Megatron's: no abbreviations, so '--flow-pack' never means '--flow-packing'.
    return add_flow_arguments(argparse.ArgumentParser(prog="mindspeed-flow flags", allow_abbrev=False))


def parse_flow_flags(argv: Sequence[str]) -> argparse.Namespace:
    """Our flags out of an argument list that may hold any upstream flags too."""
    namespace, _ = _flow_parser().parse_known_args(list(argv))
    return namespace


def env_flags(environ: Mapping[str, str] | None = None) -> list[str]:
    """The flags ``MINDSPEED_FLOW_FLAGS`` holds (``environ`` default: ``os.environ``), split as a shell would."""
    environ = os.environ if environ is None else environ
    return shlex.split(environ.get(ENV_VAR, ""))


def flags_requested(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> bool:
    """Whether the command line or the environment asks for the plugin at all.

    This is the zero-edit path's test, so it is a plain scan: ``--no-flow-X`` alone turns
    nothing on and does not count.
    """
    def asks(arg: str) -> bool:
        return arg == MASTER_FLAG or (arg.startswith("--flow-") and not arg.startswith("--no-"))
    return any(asks(a.split("=")[0]) for a in list(argv) + env_flags(environ))
