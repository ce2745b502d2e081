"""Megatron side of the ``recipes`` feature: per-module learning rates.

``megatron.core.optimizer._get_param_groups`` builds the groups (its signature changed
between 0.12 and 0.16, but the first parameter is the model chunks in both): its result is
split by module (:func:`mindspeed_flow.recipes.module_lr.split_param_groups`).
``OptimizerParamScheduler.get_lr(param_group)`` (same in 0.12 and 0.16) gives the
schedule's value for a group; the wrapper applies the module's multiplier and warm-up to
it, so Megatron's own ``lr_mult`` (0.12's ``scale_lr_cond``) still multiplies on top.

The settings come from Megatron's ``args`` when ``validate_args`` has run, else from the
command line / ``MINDSPEED_FLOW_FLAGS`` (a job that builds its optimizer without Megatron's
argument path).
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
from typing import Any, Callable

from mindspeed_flow.config import env_flags, parse_flow_flags
from mindspeed_flow.recipes.module_lr import ModuleLR, describe, module_lr, module_lr_settings, split_param_groups

log = logging.getLogger(__name__)

_settings: tuple[ModuleLR, ...] | None = None


def configure(namespace: argparse.Namespace) -> tuple[ModuleLR, ...]:
    """Read (and check) the recipe values of ``namespace``; they apply from now on."""
    global _settings
    env = parse_flow_flags(env_flags())

    def pick(dest: str):
        value = getattr(namespace, dest, None)
        return value if value is not None else getattr(env, dest, None)

    _settings = module_lr_settings(pick("flow_module_lr"), pick("flow_module_lr_warmup"))
    return _settings


def current_settings() -> tuple[ModuleLR, ...]:
    return _settings if _settings is not None else configure(parse_flow_flags(sys.argv[1:]))


def reset() -> None:
    """Forget the settings (tests; a new job in the same process)."""
    global _settings
    _settings = None


def param_groups_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> list[dict]:
    groups = wrapped(*args, **kwargs)
    chunks = args[0] if args else kwargs["model_chunks"]
    named = itertools.chain.from_iterable(chunk.named_parameters() for chunk in chunks)
    return split_param_groups(groups, named, current_settings())


def get_lr_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> float:
    group = args[0] if args else kwargs["param_group"]
    return module_lr(wrapped(*args, **kwargs), group, instance.num_steps)


def validate_args_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """After Megatron's checks: read the recipe values (a bad one fails here) and log them."""
    result = wrapped(*args, **kwargs)
    namespace = args[0] if args else kwargs["args"]
    settings = configure(namespace)
    if getattr(namespace, "rank", 0) == 0:
        log.info("mindspeed-flow recipes: %s", describe(settings))
    return result
