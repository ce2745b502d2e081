"""The job's configuration as one typed tree: the features on, and each feature's options.

The tree is resolved once, when the plugin activates, from the command line and
``MINDSPEED_FLOW_FLAGS``: for every feature switch and every option, a flag on the command
line wins over the same flag in the environment, which wins over the default.  Upstream
code reads the tree (:func:`mindspeed_flow.activation.flow_config`), never the flags, so a
value given in the environment reaches every feature exactly as the same value on the
command line does.

A feature is on when its flag says so, else when ``--use-flowtrain`` is given; an option
that only makes sense with its feature turns it on (``--flow-pool-backend``, the recipe
values), and ``--use-flowtrain`` leaves the allocator off without a plan.  Packing needs
varlen attention: MindSpeed-MM's attention honours a pack's ``cu_seqlens`` only through
``fused_attn``, so ``--flow-packing`` turns ``fused_attn`` on with it (and says so), and
``--no-flow-fused-attn`` next to packing (``--flow-packing`` or ``--use-flowtrain``) is
refused, naming both flags: the job never trains with samples attending to each other.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from .errors import FlagError
from .flags import FEATURE_NAMES, FEATURES, MASTER_DEST, MASTER_FLAG, env_flags, parse_flow_flags
from .options import (
    AllocatorOptions, PoolOptions, RecipeOptions, ScheduleOptions, SystemOptions, default_pool_backend, flag_dest,
)


# What a pack looks like to MindSpeed-MM's attention without ``fused_attn`` (pretrain_vlm.py,
# with and without --use-flash-attn): one sequence, one causal mask over the whole pack.
PACKING_WITHOUT_VARLEN = (
    "a pack reaches MindSpeed-MM's attention as one sequence with one causal mask over the whole pack "
    "(its cu_seqlens are honoured only by --flow-fused-attn's varlen path), so every token would attend "
    "to the other samples of its pack")
PACKING_TURNS_ON_VARLEN = (
    "fused_attn on with --flow-packing: packs need the varlen attention that keeps each sample to itself "
    "(without it " + PACKING_WITHOUT_VARLEN + "); --no-flow-fused-attn with packing is refused")

# The branches of the tree: the feature each options class belongs to.
OPTIONS: dict[str, type] = {"schedule": ScheduleOptions, "pool": PoolOptions, "allocator": AllocatorOptions,
                            "recipes": RecipeOptions, "system": SystemOptions}


@dataclass(frozen=True)
class FlowConfig:
    """Which features are on, and the options of each.

    ``notes`` says what the resolution decided beyond the flags as given (a feature another
    one needs, turned on with it); :meth:`describe` includes them.  ``environment`` keeps the
    ``MINDSPEED_FLOW_FLAGS`` the tree was resolved over, so that a namespace parsed later from
    the same command line can be checked against it (:func:`~.check.cross_check`).
    """

    features: frozenset[str] = field(default_factory=frozenset)
    schedule: ScheduleOptions = field(default_factory=ScheduleOptions)
    pool: PoolOptions = field(default_factory=PoolOptions)
    allocator: AllocatorOptions = field(default_factory=AllocatorOptions)
    recipes: RecipeOptions = field(default_factory=RecipeOptions)
    system: SystemOptions = field(default_factory=SystemOptions)
    notes: tuple[str, ...] = field(default=(), compare=False)
    environment: tuple[str, ...] = field(default=(), compare=False)
    # Features the flags turned on that the job's entry cannot run (:meth:`without`).
    withheld: frozenset[str] = field(default_factory=frozenset)

    def enabled(self, feature: str) -> bool:
        if feature not in FEATURE_NAMES:
            raise ValueError(f"unknown feature {feature!r}; features: {', '.join(FEATURE_NAMES)}")
        return feature in self.features

    @property
    def pool_backend(self) -> str | None:
        """The pool's backend when the pool is on, else ``None``."""
        return self.pool.backend

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace,
                       environ: Mapping[str, str] | None = None) -> "FlowConfig":
        """Resolve parsed flags (Megatron's ``args`` or ours) over the environment's flags."""
        return resolve(namespace, env_flags(environ), os.environ if environ is None else environ)

    @classmethod
    def from_argv(cls, argv: Sequence[str], environ: Mapping[str, str] | None = None) -> "FlowConfig":
        """Resolve a command line (any upstream flags may be in it) over the environment's flags."""
        return resolve(parse_flow_flags(argv), env_flags(environ), os.environ if environ is None else environ)

    def without(self, features: Iterable[str], notes: Sequence[str] = (),
                environment: Sequence[str] | None = None) -> "FlowConfig":
        """This tree with ``features`` off and recorded as withheld (an entry script they cannot
        act on: the flags asked for them, the job runs without them and ``notes`` say why);
        ``environment``: the flags a later namespace is checked over (default: this tree's)."""
        gone = frozenset(features) & self.features
        pool = PoolOptions(None) if "pool" in gone else self.pool
        # A note that resolution turned a feature on ("fused_attn on with --flow-packing: ...")
        # would contradict the withholding note that follows it.
        kept = tuple(note for note in self.notes if not any(note.startswith(f"{name} on ") for name in gone))
        return replace(self, features=self.features - gone, pool=pool, withheld=self.withheld | gone,
                       notes=(*kept, *notes),
                       environment=self.environment if environment is None else tuple(environment))

    def describe(self) -> str:
        on = [f for f in FEATURE_NAMES if f in self.features]
        text = ", ".join(on) if on else "no features"
        text += f" (pool backend {self.pool_backend})" if self.pool_backend else ""
        return "; ".join([text, *self.notes])


def _given(value: Any) -> Any:
    # argparse keeps ``nargs="+"`` values as lists; the tree is frozen, so tuples.
    return tuple(value) if isinstance(value, list) else value


def _read_options(options: type, pick: Callable[[str], Any]) -> Any:
    return options(**{f.name: _given(pick(flag_dest(f.metadata["flag"]))) for f in fields(options)})


def resolve(command_line: argparse.Namespace, environment: Sequence[str] = (),
            launcher_env: Mapping[str, str] | None = None) -> FlowConfig:
    """The tree of ``command_line`` (parsed flags) over ``environment`` (the flags of
    ``MINDSPEED_FLOW_FLAGS``, unparsed); refuses contradictions with :class:`FlagError`.
    ``launcher_env`` (the process environment torchrun set; ``None``: none) picks the pool's
    default backend (:func:`~.options.default_pool_backend`)."""
    env = parse_flow_flags(environment)

    def pick(dest: str) -> Any:
        value = getattr(command_line, dest, None)
        return value if value is not None else getattr(env, dest, None)

    options = {name: _read_options(cls, pick) for name, cls in OPTIONS.items()}
    master = bool(pick(MASTER_DEST))
    backend = options["pool"].backend
    features = set()
    for spec in FEATURES:
        explicit = pick(spec.dest)
        if spec.name == "pool" and backend is not None:
            if explicit is False:
                raise FlagError(f"--no-flow-pool contradicts --flow-pool-backend {backend}")
            explicit = True
        if spec.name == "recipes" and options["recipes"].values_given:
            if explicit is False:
                raise FlagError("--no-flow-recipes contradicts the recipe values given (--flow-module-lr ...)")
            explicit = True
        if spec.name == "allocator" and explicit is None and not options["allocator"].plan:
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
    if "pool" in features:
        options["pool"] = PoolOptions(backend or default_pool_backend(launcher_env or {}))
    else:
        options["pool"] = PoolOptions(None)
    return FlowConfig(frozenset(features), notes=tuple(notes), environment=tuple(environment), **options)
