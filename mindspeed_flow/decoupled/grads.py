"""The decoupled step's gradient averaging over the data-parallel replicas of each role.

Each slice's executor scaled its losses by its own microbatch count and summed over its
encoder replicas, so the backbone averages over its ``backbone_dp`` replicas and the encoder
over its ``encoder_dp * backbone_dp`` replicas (each slice's sum counted once per replica),
each over peers of the same TP rank (they hold the same shard).  Megatron's real job does
this with its own DDP per role (``adapters/megatron/roles.py``); ``mindspeed-flow train``
and the tests call :func:`average_grads`.

The functions take a :class:`~.layout.DecoupledLayout` (typed ``Any`` here: the layout's
methods call them, so this module does not import it back).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..schedule.regions import ENCODER_REGION


def average_grads(layout: Any, module: Any, groups: dict[str, Any]) -> None:
    """Make this rank's gradients the global batch's (see the module docstring), in one
    all-reduce per gradient dtype over the rank's ``"vit_dp"`` or ``"llm_dp"`` group
    (:func:`~.groups.new_groups`)."""
    import torch.distributed as dist

    region = layout.role(dist.get_rank()).region
    group, count = ((groups["vit_dp"], layout.encoder_dp * layout.backbone_dp) if region == ENCODER_REGION
                    else (groups["llm_dp"], layout.backbone_dp))
    average_coalesced(module.named_parameters(), group, count)


def average_coalesced(named_parameters: Iterable[tuple[str, Any]], group: Any, count: int) -> None:
    """Average the gradients of ``named_parameters`` over ``group`` (sum, then divide by
    ``count``) in one flat all-reduce per parameter dtype; every peer must agree on which
    parameters have a gradient (:func:`mindspeed_flow.flat_grads.all_reduce_flat_grads`)."""
    from ..flat_grads import all_reduce_flat_grads

    all_reduce_flat_grads(named_parameters, group, divide_by=count, agree_on_missing=True)
