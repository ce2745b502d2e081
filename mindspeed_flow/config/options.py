"""The options of each feature: one plain dataclass per feature, the leaves of the config tree.

They hold values as the flags gave them (a path, a backend name, ``PREFIX=VALUE`` entries);
reading a file or checking an entry is the feature's own business, at the moment upstream
calls it, so that an error names the flag and the file where the job would have used them.
``None`` means "not given": the feature's documented default applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

# The one list of pool backends: the flag's choices, ``mindspeed_flow.pool.BACKENDS`` and the
# doctor's availability rows all read it.
POOL_BACKENDS = ("local", "shm", "torch", "mooncake", "memfabric")
# The backend when ``--flow-pool`` (or ``--use-flowtrain``) is given without ``--flow-pool-backend``:
# shared memory when every rank of the job is on this node, point-to-point across nodes.
SINGLE_NODE_POOL_BACKEND = "shm"
MULTI_NODE_POOL_BACKEND = "torch"
DEFAULT_POOL_BACKEND_RULE = (f"{SINGLE_NODE_POOL_BACKEND} on one node, {MULTI_NODE_POOL_BACKEND} across nodes")


def default_pool_backend(environ: Mapping[str, str]) -> str:
    """The pool backend for a job whose launcher set ``environ``: ``shm`` when all its ranks
    are on this node (torchrun's ``WORLD_SIZE`` equals its ``LOCAL_WORLD_SIZE``, or the
    process was not started by a launcher), ``torch`` when they span nodes (shared memory
    cannot reach the other nodes' ranks)."""
    world, local = environ.get("WORLD_SIZE"), environ.get("LOCAL_WORLD_SIZE")
    if world is None or local is None or int(world) <= int(local):
        return SINGLE_NODE_POOL_BACKEND
    return MULTI_NODE_POOL_BACKEND


def option(flag: str) -> Any:
    """A field given by ``flag`` (not given: ``None``); the resolution reads the flag's value
    from the command line, else from ``MINDSPEED_FLOW_FLAGS``."""
    return field(default=None, metadata={"flag": flag})


def flag_dest(flag: str) -> str:
    """The attribute argparse (and so Megatron's ``args``) keeps ``flag``'s value under."""
    return flag.lstrip("-").replace("-", "_")


@dataclass(frozen=True)
class ScheduleOptions:
    """``--flow-schedule-config``: the YAML layout the runtime runs (``None``: Megatron's own
    1F1B / interleaved layout)."""

    config: str | None = option("--flow-schedule-config")


@dataclass(frozen=True)
class PoolOptions:
    """``--flow-pool-backend``: the backend, set whenever the pool is on
    (:func:`default_pool_backend` when only ``--flow-pool`` asked for it), ``None`` when it is off."""

    backend: str | None = option("--flow-pool-backend")


@dataclass(frozen=True)
class AllocatorOptions:
    """``--flow-allocator-plan``: the plan file (``mindspeed-flow plan CONFIG --out PLAN``)
    the allocator applies at start-up."""

    plan: str | None = option("--flow-allocator-plan")


@dataclass(frozen=True)
class RecipeOptions:
    """The recipe values (``--flow-module-lr`` ...), each ``PREFIX=VALUE`` entry as given.

    Every value is off unless given, so ``--use-flowtrain`` changes no number of a run;
    a value given turns the ``recipes`` feature on.  ``loss_weighting_beta`` ``None``: the
    recipe's own default momentum.
    """

    module_lr: tuple[str, ...] | None = option("--flow-module-lr")
    module_lr_warmup: tuple[str, ...] | None = option("--flow-module-lr-warmup")
    module_grad_clip: tuple[str, ...] | None = option("--flow-module-grad-clip")
    loss_weighting: tuple[str, ...] | None = option("--flow-loss-weighting")
    loss_weighting_beta: float | None = option("--flow-loss-weighting-beta")

    @property
    def values_given(self) -> bool:
        """Whether a value that changes the numbers is given (it turns ``recipes`` on)."""
        return any((self.module_lr, self.module_lr_warmup, self.module_grad_clip, self.loss_weighting))


@dataclass(frozen=True)
class SystemOptions:
    """``system`` has no options in this version: it binds each local rank's cores and sets
    the Ascend environment defaults, never overriding a variable the job set; the job's
    environment is its configuration."""
