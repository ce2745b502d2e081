"""Parameters of a megatron-core GPT pipeline stage under their *global* names.

A stage holds transformer layers ``decoder.layers.0 ..`` whatever its place in the pipeline;
renamed ``decoder.layers.{offset + i}`` (its first layer's global index plus the local one),
every split's parameters and state dicts compare key by key with the whole model's.

Imports torch only (the stage is any module with Megatron's ``decoder.layers``).
"""

from __future__ import annotations

import re
from typing import Any

import torch

_LAYER_KEY = re.compile(r"^decoder\.layers\.(\d+)\.")


def layer_offset(gpt: torch.nn.Module) -> int:
    """Global index of the stage's first transformer layer (0 for a stage without layers)."""
    layers = gpt.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def global_name(local_name: str, offset: int) -> str:
    """``decoder.layers.{i}.x`` of a stage starting at global layer ``offset`` ->
    ``decoder.layers.{offset + i}.x``; every other name is the same on every stage."""
    return _LAYER_KEY.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", local_name)


def global_state_dict(gpt: torch.nn.Module) -> dict[str, Any]:
    """The stage's state dict under global names (the whole model's for PP=1), tensors copied
    (Megatron's ``_extra_state`` entries kept, so a strict load accepts it)."""
    offset = layer_offset(gpt)
    return {global_name(name, offset): value.detach().clone() if isinstance(value, torch.Tensor) else value
            for name, value in gpt.state_dict().items()}


def stage_state_dict(state: dict[str, Any], gpt: torch.nn.Module) -> dict[str, Any]:
    """The entries of a global-name state dict (the whole model's, or any split's merged)
    that ``gpt``'s stage holds, under the stage's local names; a missing entry raises
    ``KeyError`` naming it."""
    offset = layer_offset(gpt)
    local = {}
    for name in gpt.state_dict():
        key = global_name(name, offset)
        if key not in state:
            raise KeyError(f"{key} (stage parameter {name}) is not in the state dict")
        local[name] = state[key]
    return local
