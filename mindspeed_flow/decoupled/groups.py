"""The process groups of a decoupled layout, built on every rank in the same order (a
``new_group`` is collective over the whole world)."""

from __future__ import annotations

from typing import Any

from ..schedule.regions import BACKBONE_REGION, ENCODER_REGION


def new_groups(layout: Any) -> dict[str, Any]:
    """This rank's process groups:

    - ``"vit"`` every encoder rank, ``"llm"`` every backbone rank;
    - ``"tp"`` this rank's TP group (encoder replica or backbone stage);
    - ``"replica"`` the ranks of this rank's executor (``layout.executor_ranks``);
    - ``"slice"`` every rank of its slice, all TP ranks of both roles (``layout.slice_ranks``);
    - ``"pool"`` its slice's ``pool_ranks`` (the ``group`` of a ``torch`` pool; ``None`` on
      the other ranks);
    - ``"vit_dp"`` this encoder TP rank over every encoder replica of every slice (``None``
      on backbone ranks);
    - ``"llm_dp"`` this backbone stage and TP rank over every slice (``None`` on encoder
      ranks)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    role = layout.role(rank)
    groups: dict[str, Any] = {ENCODER_REGION: dist.new_group(layout.encoder_ranks),
                              BACKBONE_REGION: dist.new_group(layout.backbone_ranks), "vit_dp": None, "llm_dp": None,
                              "pool": None}
    mine = layout.tp_group_ranks(rank)
    for first in [*layout.encoder_ranks[::layout.encoder_tp], *layout.backbone_ranks[::layout.backbone_tp]]:
        members = layout.tp_group_ranks(first)
        group = dist.new_group(members)
        if members == mine:
            groups["tp"] = group
    executor = layout.executor_ranks(rank)
    for replica in range(layout.backbone_dp):
        for t in range(max(layout.encoder_tp, layout.backbone_tp)):
            members = layout.replica_ranks(replica, *layout.slice_tp_ranks(t))
            group = dist.new_group(members)
            if members == executor:
                groups["replica"] = group
    for replica in range(layout.backbone_dp):
        group = dist.new_group(layout.slice_ranks(replica))
        if rank in layout.slice_ranks(replica):
            groups["slice"] = group
    for replica in range(layout.backbone_dp):
        group = dist.new_group(layout.pool_ranks(replica))
        if rank in layout.pool_ranks(replica):
            groups["pool"] = group
    for t in range(layout.encoder_tp):
        group = dist.new_group(layout.encoder_ranks[t::layout.encoder_tp])
        if role == (ENCODER_REGION, 0, t):
            groups["vit_dp"] = group
    for stage in range(layout.backbone_pp):
        for t in range(layout.backbone_tp):
            group = dist.new_group([layout.backbone_rank(r, stage, t) for r in range(layout.backbone_dp)])
            if role == (BACKBONE_REGION, stage, t):
                groups["llm_dp"] = group
    return groups
