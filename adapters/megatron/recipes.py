"""Megatron side of the ``recipes`` feature: per-module learning rates and gradient clipping.

``megatron.core.optimizer._get_param_groups`` builds the groups (its signature changed
between 0.12 and 0.16, but the first parameter is the model chunks in both): its result is
split by module (:func:`mindspeed_flow.recipes.module_lr.split_param_groups`).
``OptimizerParamScheduler.get_lr(param_group)`` (same in 0.12 and 0.16) gives the
schedule's value for a group; the wrapper applies the module's multiplier and warm-up to
it, so Megatron's own ``lr_mult`` (0.12's ``scale_lr_cond``) still multiplies on top.

Per-module clipping runs right after ``ChainedOptimizer.prepare_grads`` (what
``get_megatron_optimizer`` returns in 0.12 for a dense model), when the main gradients are
ready and before the global norm.  Parameters are named by the group wrapper above
(``_flow_name``), and main parameters are traced back to them through the mixed-precision
optimizer's own group lists.  The distributed optimizer is refused (its shards are not
whole parameters; not supported in this version).  FSDP2's sharded parameters (MindSpeed-MM's
``pretrain_transformers.py`` with ``use_torch_fsdp2``, where Megatron's optimizer holds the
``DTensor`` parameters) are clipped by their shards, the norms summed over the shards' group.

The settings are the config tree's recipe options (command line over ``MINDSPEED_FLOW_FLAGS``,
:func:`mindspeed_flow.activation.flow_config`), read when ``validate_args`` has run (checked
against Megatron's ``args``), else on first use (a job that builds its optimizer without
Megatron's argument path).
"""

from __future__ import annotations

import argparse
import itertools
import logging
from typing import Any, Callable

from mindspeed_flow.activation import flow_config
from mindspeed_flow.recipes.loss_weighting import LossWeightingConfig, loss_weighting_settings
from mindspeed_flow.recipes.module_clip import clip_grads_per_module
from mindspeed_flow.recipes.module_lr import (
    ModuleLR, RecipeConfigError, describe, describe_groups, grad_clip_settings, module_lr, module_lr_settings,
    split_param_groups, strip_wrappers,
)

log = logging.getLogger(__name__)

NAME_ATTR = "_flow_name"

_settings: tuple[ModuleLR, ...] | None = None
_clip: dict[str, float] = {}
_loss_weighting: LossWeightingConfig | None = None


def configure(namespace: argparse.Namespace | None = None) -> tuple[ModuleLR, ...]:
    """Read (and check) the tree's recipe values (``namespace``: Megatron's ``args``, checked
    against the tree); they apply from now on."""
    global _settings, _clip, _loss_weighting
    options = flow_config(namespace).recipes
    _settings = module_lr_settings(options.module_lr, options.module_lr_warmup)
    _clip = grad_clip_settings(options.module_grad_clip)
    _loss_weighting = loss_weighting_settings(options.loss_weighting, options.loss_weighting_beta)
    return _settings


def current_settings() -> tuple[ModuleLR, ...]:
    return _settings if _settings is not None else configure()


def current_clip() -> dict[str, float]:
    current_settings()
    return _clip


def current_loss_weighting() -> LossWeightingConfig | None:
    current_settings()
    return _loss_weighting


def reset() -> None:
    """Forget the settings (tests; a new job in the same process)."""
    global _settings, _clip, _loss_weighting
    _settings, _clip, _loss_weighting = None, {}, None


def param_groups_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> list[dict]:
    groups = wrapped(*args, **kwargs)
    chunks = args[0] if args else kwargs["model_chunks"]
    named = list(itertools.chain.from_iterable(chunk.named_parameters() for chunk in chunks))
    for name, param in named:
        setattr(param, NAME_ATTR, strip_wrappers(name))
    settings = current_settings()
    split = split_param_groups(groups, named, settings)
    if any(not s.is_identity for s in settings) and _is_first_rank():
        log.info("mindspeed-flow recipes: optimizer param groups by module: %s", describe_groups(split, settings))
    return split


def _is_first_rank() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def model_and_main_params(optimizer: Any) -> list[tuple[Any, Any]]:
    """``(model param, param holding the main gradient)`` of one Megatron optimizer."""
    if hasattr(optimizer, "shard_fp32_from_float16_groups"):
        raise RecipeConfigError("--flow-module-grad-clip does not support --use-distributed-optimizer "
                                "in this version (its main parameters are shards)")
    if hasattr(optimizer, "float16_groups"):
        pairs = [pair for model, main in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
                 for pair in zip(model, main)]
        return pairs + [(p, p) for group in optimizer.fp32_from_fp32_groups for p in group]
    if getattr(optimizer, "optimizer", None) is None:
        return []
    return [(p, p) for group in optimizer.optimizer.param_groups for p in group["params"]]


def prepare_grads_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> bool:
    """``ChainedOptimizer.prepare_grads()``, then each module's clip (skipped on inf/nan)."""
    found_inf = wrapped(*args, **kwargs)
    max_norms = current_clip()
    if found_inf or not max_norms:
        return found_inf
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    pairs = [pair for child in instance.chained_optimizers for pair in model_and_main_params(child)]
    unnamed = [tuple(p.shape) for p, _ in pairs if not hasattr(p, NAME_ATTR)]
    if unnamed:
        raise RecipeConfigError(f"--flow-module-grad-clip: {len(unnamed)} parameter(s) (first of shape "
                                f"{unnamed[0]}) were not grouped by megatron.core.optimizer._get_param_groups")
    model_of = {id(main): model for model, main in pairs}
    # FSDP2 (pretrain_transformers.py): DTensor parameters, their gradients sharded over a group
    from megatron.core.utils import get_data_parallel_group_if_dtensor

    shard_group = None
    for model, _ in pairs:
        shard_group = get_data_parallel_group_if_dtensor(model, shard_group)

    def counts(main: Any) -> bool:
        model = model_of[id(main)]
        return param_is_not_shared(model) and param_is_not_tensor_parallel_duplicate(model)

    instance.flow_module_grad_norms = clip_grads_per_module(
        [(getattr(model, NAME_ATTR), main) for model, main in pairs], max_norms,
        group=instance.get_grad_stats_parallel_group(), counts_for_norm=counts, shard_group=shard_group,
        device=pairs[0][1].device if pairs else None)
    clipped = {m: n for m, n in instance.flow_module_grad_norms.items() if n > max_norms[m]}
    if clipped and _is_first_rank():
        log.info("mindspeed-flow recipes: clipped module gradients (norm before > max): %s",
                 ", ".join(f"{m} {n:.4g} > {max_norms[m]:g}" for m, n in sorted(clipped.items())))
    log.debug("mindspeed-flow module grad norms: %s", instance.flow_module_grad_norms)
    return found_inf


def get_lr_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> float:
    group = args[0] if args else kwargs["param_group"]
    return module_lr(wrapped(*args, **kwargs), group, instance.num_steps)


def validate_args_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """After Megatron's checks: read the recipe values (a bad one fails here) and log them."""
    result = wrapped(*args, **kwargs)
    namespace = args[0] if args else kwargs["args"]
    settings = configure(namespace)
    if getattr(namespace, "rank", 0) == 0:
        log.info("mindspeed-flow recipes: %s; per-module grad clip %s; loss weighting %s", describe(settings),
                 _clip or "off", _loss_weighting.describe() if _loss_weighting else "off")
    return result
