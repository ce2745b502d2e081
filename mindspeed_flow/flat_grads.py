"""Gradients moved as one flat buffer: one collective for many parameters.

Every gradient exchange of the project goes through here: the main job's data-parallel sum
(``train.trainer``), the decoupled layout's averages (``decoupled.grads``) and the runtime's
replica reduce (``runtime.step``, which sums the same flat buffer point to point in group
order).  One collective per dtype instead of one per parameter: each would pay the
collective's latency on the step's critical path.

Imports torch only.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence, Union

import torch

Named = tuple[str, torch.nn.Parameter]


def _grad_or_zeros(param: torch.Tensor) -> torch.Tensor:
    """``param``'s gradient as a 1-D view, a missing gradient as zeros (peers' buffers line up)."""
    return (param.grad if param.grad is not None else torch.zeros_like(param)).reshape(-1)


def accumulated_grad(param: torch.Tensor) -> torch.Tensor | None:
    """Where ``param``'s gradient accumulates: Megatron DDP's ``main_grad`` buffer view when
    the parameter has one (DDP's hooks add ``.grad`` into it during backward and clear
    ``.grad``), else ``.grad``."""
    main = getattr(param, "main_grad", None)
    return main if main is not None else param.grad


def flatten_grads(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The gradients of ``params`` (:func:`accumulated_grad`) end to end in one 1-D tensor,
    a missing gradient as zeros."""
    return torch.cat([g.reshape(-1) if (g := accumulated_grad(p)) is not None else torch.zeros_like(p).reshape(-1)
                      for p in params])


def set_accumulated_grads(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Consecutive slices of ``flat`` as the gradients of ``params``: copied into DDP's
    ``main_grad`` where the parameter has one (what Megatron's optimizer reads), else set as
    ``.grad``."""
    offset = 0
    with torch.no_grad():
        for p in params:
            value = flat[offset: offset + p.numel()]
            offset += p.numel()
            main = getattr(p, "main_grad", None)
            if main is not None:
                main.copy_(value.view_as(main))
            else:
                p.grad = value.view_as(p).to(p.dtype).clone()


def scatter_flat(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (the inverse of flattening them)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset: offset + t.numel()].view_as(t))
            offset += t.numel()


def all_reduce_flat_grads(params: Iterable[Union[torch.nn.Parameter, Named]], group: Any = None, *,
                          divide_by: int = 1, agree_on_missing: bool = False) -> None:
    """Sum the gradients of ``params`` (parameters, or ``(name, parameter)`` pairs) over
    ``group`` and divide them by ``divide_by``, in one flat all-reduce per parameter dtype.

    Parameters that do not require a gradient are left alone.  The flat buffer holds the
    others in order, a missing gradient as zeros, so the peers' buffers line up whenever
    they hold the same parameters (same-TP-rank peers hold the same shards).

    ``agree_on_missing=False``: a missing gradient counts as zeros and gets the result.
    ``agree_on_missing=True``: the buffer also carries two flags per parameter, "has a
    gradient" and "has none", whose sums say, exactly in any float dtype (a sum of ones is
    never zero), whether every peer, none or only some had one: every peer - the result is
    written back; none - the gradient stays ``None``; only some - ``ValueError`` naming the
    parameter, on every peer alike, before any gradient changes (the peers' gradients would
    otherwise diverge).

    A group of one rank with nothing to divide changes nothing and runs no collective."""
    import torch.distributed as dist

    if dist.get_world_size(group) == 1 and divide_by == 1:
        return
    buckets: dict[Any, list[Named]] = {}
    for index, item in enumerate(params):
        name, param = item if isinstance(item, tuple) else (f"#{index}", item)
        if param.requires_grad:
            buckets.setdefault(param.dtype, []).append((name, param))
    reduced = []
    for dtype, named in buckets.items():
        grads = [_grad_or_zeros(p) for _, p in named]
        numel = sum(g.numel() for g in grads)
        if agree_on_missing:
            flags = torch.tensor([[p.grad is not None, p.grad is None] for _, p in named], dtype=dtype,
                                 device=grads[0].device)
            grads.append(flags.reshape(-1))
        flat = torch.cat(grads)
        dist.all_reduce(flat, group=group)
        present = [True] * len(named)
        if agree_on_missing:
            has, lacks = flat[numel:].view(-1, 2).unbind(1)
            mixed = [name for (name, _), h, n in zip(named, has.tolist(), lacks.tolist()) if h and n]
            if mixed:
                raise ValueError(f"average_grads: parameters {mixed} have a gradient on some ranks of the group and "
                                 f"none on others; every peer must compute gradients for the same parameters")
            present = [bool(h) for h in has.tolist()]
        values = flat[:numel]
        if divide_by != 1:
            values = values.div_(divide_by)
        reduced.append((named, values, present))
    for named, values, present in reduced:
        for (_, param), value, keep in zip(named, values.split([p.numel() for _, p in named]), present):
            if not keep:
                continue
            if param.grad is None:
                param.grad = value.view_as(param).clone()
            else:
                param.grad.copy_(value.view_as(param.grad))
