"""Per-module learning rates: a multiplier and an optional own linear warm-up per module.

A module is a parameter-name prefix: MindSpeed-MM's ``VLMModel`` (``pretrain_vlm.py``) has
``image_encoder.encoder``, ``image_encoder.projector``, ``text_decoder``; its
``TransformersModel`` (``pretrain_transformers.py``, e.g. Qwen3-VL) holds the Hugging Face model
as ``model``: ``model.model.visual`` (ViT, with ``model.model.visual.merger`` and
``model.model.visual.deepstack_merger_list``), ``model.model.language_model``, ``model.lm_head``.
A multiplier of 0 stops a module's updates (its learning rate is 0; it still gets gradients).  Megatron builds the optimizer's param
groups; :func:`split_param_groups` splits each of them into one group per configured
module and tags it, and :func:`module_lr` turns the schedule's learning rate into the
module's::

    lr_module(step) = lr_schedule(step) * mult * min(1, step / warmup)   (warmup > 0)
    lr_module(step) = lr_schedule(step) * mult                            (warmup = 0)

A module whose multiplier is 1 and warm-up 0 is left in Megatron's groups untouched, so a
run with every multiplier at 1 builds exactly the groups it would without the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence, TypeVar

import torch

from .errors import RecipeConfigError

MODULE_PREFIXES = ("image_encoder.encoder", "image_encoder.projector", "text_decoder")
# TransformersModel's (pretrain_transformers.py, Qwen3-VL) main parts
TRANSFORMERS_MODULE_PREFIXES = ("model.model.visual", "model.model.language_model", "model.lm_head")
MODULE_KEY = "flow_module"
MULT_KEY = "flow_lr_mult"
WARMUP_KEY = "flow_lr_warmup_steps"
_WRAPPER_PREFIX = "module."

T = TypeVar("T")


@dataclass(frozen=True)
class ModuleLR:
    """One module's learning-rate setting."""

    prefix: str
    mult: float = 1.0
    warmup_steps: int = 0

    @property
    def is_identity(self) -> bool:
        return self.mult == 1.0 and self.warmup_steps == 0


def parse_assignments(entries: Sequence[str] | None, flag: str, cast: Callable[[str], T],
                      check: Callable[[T], bool], expected: str) -> dict[str, T]:
    """``["PREFIX=VALUE", ...]`` -> ``{prefix: value}``; a bad entry raises naming ``flag``."""
    values: dict[str, T] = {}
    for entry in entries or ():
        prefix, sep, raw = entry.partition("=")
        if not sep or not prefix:
            raise RecipeConfigError(f"{flag}: {entry!r} is not PREFIX=VALUE (e.g. image_encoder.encoder=0.1)")
        try:
            value = cast(raw)
        except ValueError:
            raise RecipeConfigError(f"{flag}: {entry!r}: {raw!r} is not {expected}") from None
        if not check(value):
            raise RecipeConfigError(f"{flag}: {entry!r}: value must be {expected}")
        if prefix in values:
            raise RecipeConfigError(f"{flag}: module {prefix!r} given twice")
        values[prefix] = value
    return values


def module_lr_settings(mults: Sequence[str] | None, warmups: Sequence[str] | None) -> tuple[ModuleLR, ...]:
    """The settings of ``--flow-module-lr`` and ``--flow-module-lr-warmup``."""
    mult = parse_assignments(mults, "--flow-module-lr", float, lambda v: v >= 0 and v != float("inf"),
                             "a finite number >= 0")
    warm = parse_assignments(warmups, "--flow-module-lr-warmup", int, lambda v: v >= 0, "an integer >= 0")
    prefixes = list(dict.fromkeys([*mult, *warm]))
    return tuple(ModuleLR(p, mult.get(p, 1.0), warm.get(p, 0)) for p in prefixes)


def strip_wrappers(name: str) -> str:
    """``module.module.text_decoder.x`` (DDP / Float16Module) -> ``text_decoder.x``."""
    while name.startswith(_WRAPPER_PREFIX):
        name = name[len(_WRAPPER_PREFIX):]
    return name


def owning_prefix(name: str, prefixes: Iterable[str]) -> str | None:
    """The longest of ``prefixes`` that names parameter ``name`` (``None``: none does)."""
    name = strip_wrappers(name)
    hits = [p for p in prefixes if name == p or name.startswith(p + ".")]
    return max(hits, key=len) if hits else None


def module_of(name: str, settings: Sequence[ModuleLR]) -> ModuleLR | None:
    """The setting whose prefix owns ``name`` (``None``: no module)."""
    prefix = owning_prefix(name, (s.prefix for s in settings))
    return next(s for s in settings if s.prefix == prefix) if prefix is not None else None


def split_param_groups(groups: list[dict[str, Any]], named_parameters: Iterable[tuple[str, torch.Tensor]],
                       settings: Sequence[ModuleLR]) -> list[dict[str, Any]]:
    """Each group split by module; a module's group carries its multiplier and warm-up.

    Parameters of identity modules (and of no module) stay in the group they were in, in
    their order; a group is emitted only if it holds parameters.
    """
    active = [s for s in settings if not s.is_identity]
    if not active:
        return groups
    owner = {id(p): module_of(n, active) for n, p in named_parameters}
    result: list[dict[str, Any]] = []
    for group in groups:
        parts: dict[ModuleLR | None, list[torch.Tensor]] = {}
        for param in group["params"]:
            parts.setdefault(owner.get(id(param)), []).append(param)
        for setting, params in parts.items():
            part = {**group, "params": params}
            if setting is not None:
                part.update({MODULE_KEY: setting.prefix, MULT_KEY: setting.mult, WARMUP_KEY: setting.warmup_steps})
            result.append(part)
    return result


def describe_groups(groups: Sequence[dict[str, Any]], settings: Sequence[ModuleLR]) -> str:
    """Each configured module's share of split param groups, in words: its multiplier and how
    many parameter tensors it got (0: its prefix names no parameter of this rank's model)."""
    counts = {s.prefix: 0 for s in settings if not s.is_identity}
    for group in groups:
        if MODULE_KEY in group:
            counts[group[MODULE_KEY]] += len(group["params"])
    parts = []
    for setting in settings:
        if not setting.is_identity:
            parts.append(f"{setting.prefix} x{setting.mult:g} ({counts[setting.prefix]} tensors)")
    return ", ".join(parts)


def module_lr(schedule_lr: float, group: dict[str, Any], step: int) -> float:
    """The learning rate of ``group`` at ``step`` given the schedule's (see module doc)."""
    if MODULE_KEY not in group:
        return schedule_lr
    lr = schedule_lr * group[MULT_KEY]
    warmup = group[WARMUP_KEY]
    if warmup > 0 and step < warmup:
        lr = lr * step / warmup
    return lr


def grad_clip_settings(entries: Sequence[str] | None) -> dict[str, float]:
    """The maximum norms of ``--flow-module-grad-clip``."""
    return parse_assignments(entries, "--flow-module-grad-clip", float,
                             lambda v: v > 0 and v != float("inf"), "a positive finite number")


def describe(settings: Sequence[ModuleLR]) -> str:
    if not settings:
        return "per-module LR off"
    return "per-module LR " + ", ".join(
        f"{s.prefix} x{s.mult:g}" + (f" warm-up {s.warmup_steps}" if s.warmup_steps else "") for s in settings)
