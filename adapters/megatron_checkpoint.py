"""Megatron distributed checkpoints (``--ckpt-format torch_dist``) of a model whose patch
embedding runs as a matmul (feature ``conv_matmul``).

``PatchEmbedMatmul`` keeps its kernel as a linear weight ``[E, C*prod(k)]``; upstream
checkpoints hold the conv weight ``[E, C, *k]``.  A ``torch`` checkpoint is one state
dict and the module's load pre-hook reshapes it; a ``torch_dist`` checkpoint is read
tensor by tensor against the *sharded* state dict, whose shapes must match the saved
ones exactly, and the distributed optimizer keys its states by the same entries.

So the weight enters Megatron's sharded state dict as a ``ShardedTensorFactory`` whose
tensor is saved in the conv layout (a view of the same storage: same element order, so a
flat optimizer slice maps to the same range) and merged back to the linear layout after
loading.  Optimizer states go through the same factory.  A patched job therefore writes
checkpoints upstream reads and reads upstream's: no conversion step for ``torch_dist``.

Megatron collects sharded state dicts by calling ``sharded_state_dict`` where a module has
one and the plain ``state_dict`` otherwise; MindSpeed-MM's ``PatchEmbed`` is a plain
``nn.Module``, so its instance is given Megatron's own recursive implementation
(``MegatronModule.sharded_state_dict``) to reach the matmul's.  Megatron is imported
only when a checkpoint is written or read.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn

from mindspeed_flow.attention.patch_embed import PatchEmbedMatmul

Offsets = tuple[tuple[int, int, int], ...]


def attach_conv_layout_checkpointing(parent: nn.Module, attribute: str) -> None:
    """Make ``parent.<attribute>`` (a ``PatchEmbedMatmul``) save and load its weight in the
    conv layout in Megatron's distributed checkpoints."""
    module = getattr(parent, attribute)
    if not isinstance(module, PatchEmbedMatmul):
        raise TypeError(f"{type(parent).__name__}.{attribute} is {type(module).__name__}, not PatchEmbedMatmul")
    module.sharded_state_dict = functools.partial(conv_layout_sharded_state_dict, module)
    if not hasattr(parent, "sharded_state_dict"):
        parent.sharded_state_dict = functools.partial(_recursive_sharded_state_dict, parent)


def conv_layout_sharded_state_dict(
    module: PatchEmbedMatmul, prefix: str = "", sharded_offsets: Offsets = (), metadata: Optional[dict] = None
) -> dict[str, Any]:
    """Megatron's default sharded state dict of ``module`` (replicated over TP and DP),
    with ``weight`` as a factory that saves ``[E, C, *kernel]``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    sharded = make_sharded_tensors_for_checkpoint(
        module.state_dict(prefix="", keep_vars=True), prefix, {}, sharded_offsets
    )
    key = f"{prefix}weight"
    flat = sharded[key]
    sharded[key] = ShardedTensorFactory(
        flat.key,
        flat.data,
        functools.partial(_build_conv_layout, module.conv_weight_shape, tuple(sharded_offsets)),
        functools.partial(_merge_to_linear_layout, module.out_channels),
        flat.replica_id,
    )
    return sharded


def _build_conv_layout(
    conv_shape: tuple[int, ...], sharded_offsets: Offsets, key: str, data: torch.Tensor, replica_id: Any,
    flattened_range: Optional[slice],
) -> Any:
    """The saved tensor: the linear weight (or an optimizer state of its shape) as
    ``conv_shape``; a flat slice (distributed optimizer) keeps its range, since both
    layouts order the elements alike."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    if flattened_range is None:
        return ShardedTensor.from_rank_offsets(
            key, data.view(conv_shape), *sharded_offsets, replica_id=replica_id,
            prepend_axis_num=len(sharded_offsets),
        )
    return ShardedTensor.from_rank_offsets_flat(
        key, data, conv_shape, *sharded_offsets, flattened_range=flattened_range, replica_id=replica_id,
        prepend_axis_num=len(sharded_offsets),
    )


def _merge_to_linear_layout(out_channels: int, loaded: torch.Tensor) -> torch.Tensor:
    """A loaded conv-layout tensor as the linear weight; a flat slice stays flat."""
    return loaded.reshape(out_channels, -1) if loaded.dim() > 2 else loaded


def _recursive_sharded_state_dict(
    parent: nn.Module, prefix: str = "", sharded_offsets: Offsets = (), metadata: Optional[dict] = None
) -> dict[str, Any]:
    """Megatron's ``MegatronModule.sharded_state_dict`` on a plain module: its own tensors
    replicated, each child through ``sharded_state_dict_default`` (so the matmul's own)."""
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule.sharded_state_dict(parent, prefix, sharded_offsets, metadata)
