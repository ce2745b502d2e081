"""Tensor parallelism for a decoupled encoder replica, in plain PyTorch (gloo or any
``torch.distributed`` backend, no Megatron).

The replica's linear layers are split over its TP group (column-parallel, then
row-parallel, Megatron's pairing: one all-reduce in the forward, one in the backward), so
every TP rank ends the forward holding the same, whole output.  Every TP rank runs the
slice's plan (:meth:`mindspeed_flow.decoupled.DecoupledLayout.executor_ranks`); only the replica's TP
leader puts the embeddings and gets their gradient, which it broadcasts to the others
(:class:`mindspeed_flow.pool.tensor_parallel.TensorParallelPool`).  A shard carries Megatron's attributes
(``tensor_model_parallel``, ``partition_dim``), so code that handles Megatron's TP
parameters handles these too.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient (each rank saw a shard's part)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """All-reduce of the partial sums forward; identity backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _shard(t: torch.Tensor, dim: int, group: Any) -> nn.Parameter:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[dim] % size:
        raise ValueError(f"encoder TP: dimension {dim} of size {t.shape[dim]} does not split over {size} ranks")
    shard = nn.Parameter(t.detach().chunk(size, dim)[rank].clone())
    shard.tensor_model_parallel, shard.partition_dim, shard.partition_stride = True, dim, 1
    return shard


class ColumnParallelLinear(nn.Module):
    """This TP rank's output features of ``full`` (its rows of the weight and bias)."""

    def __init__(self, full: nn.Linear, group: Any) -> None:
        super().__init__()
        self.group = group
        self.weight, self.bias = _shard(full.weight, 0, group), _shard(full.bias, 0, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(_CopyToGroup.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """This TP rank's input features of ``full``; the partial products are summed over the
    group, then the (whole, replicated) bias added."""

    def __init__(self, full: nn.Linear, group: Any) -> None:
        super().__init__()
        self.group = group
        self.weight, self.bias = _shard(full.weight, 1, group), nn.Parameter(full.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromGroup.apply(nn.functional.linear(x, self.weight), self.group) + self.bias
