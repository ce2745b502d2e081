"""The plugin's switches: ``--use-flowtrain``, one flag per feature, and the environment.

Every feature has ``--flow-X`` / ``--no-flow-X``.  A feature is on when its flag says so,
else when ``--use-flowtrain`` is given.  Jobs whose command line cannot change put the same
flags in ``MINDSPEED_FLOW_FLAGS`` (e.g. ``MINDSPEED_FLOW_FLAGS="--use-flowtrain
--no-flow-allocator"``); a flag on the command line wins over the environment.

Packing needs varlen attention: MindSpeed-MM's attention honours a pack's ``cu_seqlens``
only through ``fused_attn``, so ``--flow-packing`` turns ``fused_attn`` on with it (and
says so), and ``--no-flow-fused-attn`` next to packing (``--flow-packing`` or
``--use-flowtrain``) is refused, naming both flags: the job never trains with samples
attending to each other.

The flags are added to upstream's own parser (Megatron's ``parse_args`` through its
``extra_args_provider``, MindSpeed's feature manager), so ``add_flow_arguments`` is
idempotent: whichever path comes second finds them registered and adds nothing.
"""

from __future__ import annotations

import argparse
import os
import shlex
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from mindspeed_flow.recipes.flags import RECIPE_VALUE_DESTS, add_recipe_arguments

ENV_VAR = "MINDSPEED_FLOW_FLAGS"
MASTER_FLAG = "--use-flowtrain"
POOL_BACKENDS = ("local", "shm", "torch", "mooncake", "memfabric")
DEFAULT_POOL_BACKEND = "torch"


@dataclass(frozen=True)
class FeatureSpec:
    """A switchable feature: its registry name and the flag that turns it on."""

    name: str
    flag: str
    help: str

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


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
                       help=f"memory pool backend; implies --flow-pool (default: {DEFAULT_POOL_BACKEND})")
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


class FlagError(ValueError):
    """Flags that contradict each other, or that would make the job train silently wrong:
    start-up refuses them, naming the flags."""


# What a pack looks like to MindSpeed-MM's attention without ``fused_attn`` (pretrain_vlm.py,
# with and without --use-flash-attn): one sequence, one causal mask over the whole pack.
PACKING_WITHOUT_VARLEN = (
    "a pack reaches MindSpeed-MM's attention as one sequence with one causal mask over the whole pack "
    "(its cu_seqlens are honoured only by --flow-fused-attn's varlen path), so every token would attend "
    "to the other samples of its pack")
PACKING_TURNS_ON_VARLEN = (
    "fused_attn on with --flow-packing: packs need the varlen attention that keeps each sample to itself "
    "(without it " + PACKING_WITHOUT_VARLEN + "); --no-flow-fused-attn with packing is refused")


@dataclass(frozen=True)
class FlowConfig:
    """Resolved switches: which features are on, and the pool backend.

    ``notes`` says what the resolution decided beyond the flags as given (a feature another
    one needs, turned on with it); :meth:`describe` includes them.
    """

    features: frozenset[str] = field(default_factory=frozenset)
    pool_backend: str | None = None
    notes: tuple[str, ...] = field(default=(), compare=False)

    def enabled(self, feature: str) -> bool:
        if feature not in FEATURE_NAMES:
            raise ValueError(f"unknown feature {feature!r}; features: {', '.join(FEATURE_NAMES)}")
        return feature in self.features

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace,
                       environ: Mapping[str, str] | None = None) -> "FlowConfig":
        """Resolve parsed flags (Megatron's ``args`` or ours) over the environment's flags."""
        env = parse_flow_flags(env_flags(environ))

        def pick(dest: str):
            value = getattr(namespace, dest, None)
            return value if value is not None else getattr(env, dest, None)

        master = bool(pick("use_flowtrain"))
        backend = pick("flow_pool_backend")
        features = set()
        for spec in FEATURES:
            explicit = pick(spec.dest)
            if spec.name == "pool" and backend is not None:
                if explicit is False:
                    raise FlagError(f"--no-flow-pool contradicts --flow-pool-backend {backend}")
                explicit = True
            if spec.name == "recipes" and any(pick(d) for d in RECIPE_VALUE_DESTS):
                if explicit is False:
                    raise FlagError("--no-flow-recipes contradicts the recipe values given (--flow-module-lr ...)")
                explicit = True
            if spec.name == "allocator" and explicit is None and not pick("flow_allocator_plan"):
                # Without a plan the allocator has nothing to apply: --use-flowtrain leaves it
                # off rather than refusing to start; --flow-allocator alone still asks for one.
                continue
            if explicit or (explicit is None and master):
                features.add(spec.name)
        notes = []
        if "packing" in features and "fused_attn" not in features:
            if pick("flow_fused_attn") is False:
                packing = "--flow-packing" if pick("flow_packing") else f"--flow-packing (on under {MASTER_FLAG})"
                raise FlagError(
                    f"--no-flow-fused-attn with {packing}: {PACKING_WITHOUT_VARLEN}. Drop --no-flow-fused-attn "
                    "(varlen attention: each sample attends only to itself), or add --no-flow-packing "
                    "(MindSpeed-MM's own data path)")
            features.add("fused_attn")
            notes.append(PACKING_TURNS_ON_VARLEN)
        if "pool" in features and backend is None:
            backend = DEFAULT_POOL_BACKEND
        return cls(frozenset(features), backend if "pool" in features else None, tuple(notes))

    @classmethod
    def from_argv(cls, argv: Sequence[str], environ: Mapping[str, str] | None = None) -> "FlowConfig":
        return cls.from_namespace(parse_flow_flags(argv), environ)

    def describe(self) -> str:
        on = [f for f in FEATURE_NAMES if f in self.features]
        text = ", ".join(on) if on else "no features"
        text += f" (pool backend {self.pool_backend})" if self.pool_backend else ""
        return "; ".join([text, *self.notes])
