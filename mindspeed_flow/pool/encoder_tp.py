"""Tensor parallelism for a decoupled encoder replica, in plain PyTorch (gloo or any
``torch.distributed`` backend, no Megatron).

The replica's linear layers are split over its TP group (column-parallel, then
row-parallel, Megatron's pairing: one all-reduce in the forward, one in the backward), so
every TP rank ends the forward holding the same, whole output.  Only the replica's TP
*leader* is a rank of the step's plan: it ``PUT``s the embeddings and ``GET``s their
gradient; :class:`LeaderOutput` broadcasts that gradient to the other TP ranks, which
:func:`follow` the leader's program (its forwards and backwards, in its order) so that
their collectives pair with the leader's.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..schedule.actions import Action, Kind


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


class _BroadcastGrad(torch.autograd.Function):
    """Identity forward; the backward sends the output gradient from ``src`` to the group."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, src: int, group: Any) -> torch.Tensor:
        ctx.src, ctx.group = src, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.broadcast(grad, src=ctx.src, group=ctx.group)
        return grad, None, None


def _shard(t: torch.Tensor, dim: int, group: Any) -> nn.Parameter:
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if t.shape[dim] % size:
        raise ValueError(f"encoder TP: dimension {dim} of size {t.shape[dim]} does not split over {size} ranks")
    return nn.Parameter(t.detach().chunk(size, dim)[rank].clone())


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


class LeaderOutput(nn.Module):
    """The TP leader's encoder as the plan sees it: ``module``'s output, whose gradient is
    broadcast to the TP group (global rank ``leader``) when the leader runs its backward."""

    def __init__(self, module: nn.Module, group: Any, leader: int) -> None:
        super().__init__()
        self.module, self.group, self.leader = module, group, leader

    def set_input_tensor(self, tensors: list) -> None:
        """The first region: nothing comes in."""

    def forward(self, batch: dict) -> torch.Tensor:
        return _BroadcastGrad.apply(self.module(batch), self.leader, self.group)


def follow(program: Sequence[Action], region: str, module: Callable[[dict], torch.Tensor],
           batches: Sequence[dict], group: Any, leader: int) -> None:
    """Run, on a TP rank that is not the leader, the leader's forwards and backwards of
    ``region`` in the leader's order (``program``: the leader's plan program), taking each
    output gradient from the leader's broadcast."""
    outputs: dict[int, torch.Tensor] = {}
    for a in program:
        if a.region != region:
            continue
        if a.kind is Kind.FORWARD:
            outputs[a.microbatch] = module(batches[a.microbatch])
        elif a.kind is Kind.BACKWARD:
            out = outputs.pop(a.microbatch)
            grad = torch.empty_like(out)
            dist.broadcast(grad, src=leader, group=group)
            out.backward(grad)
        elif a.kind in (Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT, Kind.PARAM_BROADCAST, Kind.GRAD_REDUCE):
            raise ValueError(f"encoder TP: the leader's program has {a} (split backwards and replicated "
                             f"encoders, encoder_dp > 1, are not supported with TP followers)")
