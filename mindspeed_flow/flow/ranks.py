"""Which rank runs what in a flow job: the ranks of :func:`~.plan.compose_flow`'s plan.

Ranks ``0 .. E-1`` are the encoder replicas (producers); rank ``E + d*PP + s`` is stage ``s``
of backbone replica ``d`` (stage 0 is the consumer).  The encoder replicas serve every
backbone replica: the grouping deals the encoder batches over the replicas by their cost
(:func:`~.grouping.group_step`), whichever backbone replica their samples go to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..schedule.regions import BACKBONE_REGION, ENCODER_REGION
from .errors import GroupingError
from .grouping import FlowGrouping


class FlowRole(NamedTuple):
    """``region``: ``"vit"`` (a producer) or ``"llm"`` (a backbone stage); ``replica``: the
    encoder replica, or the backbone's data-parallel replica; ``stage``: the pipeline stage
    (0 for an encoder replica)."""

    region: str
    replica: int
    stage: int


@dataclass(frozen=True)
class FlowRanks:
    """The placement of ``encoder_replicas`` producers and a ``dp`` x ``pp`` backbone."""

    encoder_replicas: int
    dp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        for name in ("encoder_replicas", "dp", "pp"):
            if getattr(self, name) < 1:
                raise GroupingError(f"FlowRanks: {name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def of(cls, grouping: FlowGrouping) -> "FlowRanks":
        return cls(grouping.encoder_replicas, grouping.dp, grouping.pp)

    @property
    def world_size(self) -> int:
        return self.encoder_replicas + self.dp * self.pp

    @property
    def encoder_ranks(self) -> list[int]:
        return list(range(self.encoder_replicas))

    def stage_rank(self, replica: int, stage: int) -> int:
        """The global rank of stage ``stage`` of backbone replica ``replica``."""
        if not (0 <= replica < self.dp and 0 <= stage < self.pp):
            raise GroupingError(f"FlowRanks: no stage {stage} of backbone replica {replica} "
                                f"(dp={self.dp}, pp={self.pp})")
        return self.encoder_replicas + replica * self.pp + stage

    def pipeline(self, replica: int) -> list[int]:
        """Backbone replica ``replica``'s stages (an :class:`~mindspeed_flow.runtime.Executor`'s ranks)."""
        return [self.stage_rank(replica, s) for s in range(self.pp)]

    def stage_peers(self, stage: int) -> list[int]:
        """Stage ``stage`` of every backbone replica (its data-parallel gradient group)."""
        return [self.stage_rank(d, stage) for d in range(self.dp)]

    def role(self, rank: int) -> FlowRole:
        if not 0 <= rank < self.world_size:
            raise GroupingError(f"FlowRanks: rank {rank} outside the world of {self.world_size}")
        if rank < self.encoder_replicas:
            return FlowRole(ENCODER_REGION, rank, 0)
        local = rank - self.encoder_replicas
        return FlowRole(BACKBONE_REGION, local // self.pp, local % self.pp)
