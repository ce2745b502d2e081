"""Per-module gradient clipping, before the global clip.

Each configured module (a parameter-name prefix) has its own maximum norm; its gradient is
scaled by ``max_norm / (norm + 1e-6)`` when that is below 1 (Megatron's global rule), so a
spike in one modality does not shrink the other modules' updates through the global norm.

A module's norm is over all of its parameters, wherever they live: the local sums of
squares of every module are all-reduced in one tensor over ``group`` (pass the group
Megatron reduces its global norm over: the model-parallel group for the plain optimizer,
where data-parallel replicas hold equal gradients; the whole world for the distributed
one).  ``counts_for_norm`` leaves out parameters that another rank also holds (tensor-
parallel duplicates), as Megatron does; their gradients are still scaled.

Gradients sharded by FSDP2 (``DTensor``, ``pretrain_transformers.py`` with
``use_torch_fsdp2``) count by their local shard; the sums are first all-reduced over
``shard_group``, the group the shards are spread over, as Megatron's own norm does for them.

The sums are fp32 on ``device`` (default: the first gradient's), as Megatron's norm is: HCCL
reduces no float64, nor CPU tensors; and float64 over FSDP2's mesh group was seen not to reduce
at all in the CPU real job (the module norm was one rank's).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .module_lr import owning_prefix

EPS = 1e-6


@torch.no_grad()
def clip_grads_per_module(named_params: Iterable[tuple[str, torch.Tensor]], max_norms: Mapping[str, float],
                          group: dist.ProcessGroup | None = None,
                          counts_for_norm: Callable[[torch.Tensor], bool] = lambda p: True,
                          shard_group: dist.ProcessGroup | None = None,
                          device: torch.device | None = None) -> dict[str, float]:
    """Clip each module's gradients to its maximum norm in place; returns the norms before.

    Every rank must call this with the same ``max_norms`` (one collective, modules in sorted
    order; one more over ``shard_group`` when given), also a rank that holds none of a
    module's parameters.
    """
    modules = sorted(max_norms)
    index = {m: i for i, m in enumerate(modules)}
    named_params = list(named_params)
    if device is None:
        device = next((p.grad.device for _, p in named_params if p.grad is not None), torch.device("cpu"))
    sums = torch.zeros(len(modules), dtype=torch.float32, device=device)
    members: list[list[torch.Tensor]] = [[] for _ in modules]
    for name, param in named_params:
        grad = param.grad
        module = owning_prefix(name, modules)
        if grad is None or module is None:
            continue
        if isinstance(grad, DTensor):
            grad = grad.to_local()
        members[index[module]].append(grad)
        if counts_for_norm(param):
            sums[index[module]] += grad.detach().float().pow(2).sum().to(device)
    if shard_group is not None:
        dist.all_reduce(sums, group=shard_group)
    if group is not None or (dist.is_available() and dist.is_initialized()):
        dist.all_reduce(sums, group=group)
    norms = sums.sqrt()
    for i, module in enumerate(modules):
        coeff = max_norms[module] / (float(norms[i]) + EPS)
        if coeff < 1.0:
            for grad in members[i]:
                grad.mul_(coeff)
    return {m: float(norms[i]) for i, m in enumerate(modules)}
