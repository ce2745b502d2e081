"""FlowTrain's decoupled layout: encoder ranks of their own produce embeddings into the
pool, backbone ranks consume them.

One world, two parallel configs: the first ``encoder_dp`` ranks are encoder replicas
(microbatch ``m`` on replica ``m % encoder_dp``, at most ``max_ahead`` microbatches ahead
of their backward), the next ``backbone_pp`` ranks are the backbone's pipeline stages.
The step is the composed plan of ``<Decoupled, 1F1B>``: encoder forwards ``PUT`` their
embeddings, the first backbone stage ``GET``s each microbatch's embeddings when it needs
them (whichever replica made them), and ``PUT``s their gradients back, which the owning
replica ``GET``s for its backward; the replicas then reduce their weight gradients among
themselves only (the plan's ``REDUCE`` over the encoder group).  The math is synchronous
training's: same samples, same gradients; only the timing is decoupled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..schedule import Decoupled, OneFOneB, Region, compose
from ..schedule.plan import Plan

ENCODER = "vit"
BACKBONE = "llm"


@dataclass(frozen=True)
class DecoupledLayout:
    """Attributes:
        encoder_dp: encoder replicas (data parallel).
        backbone_pp: backbone pipeline stages.
        max_ahead: microbatches an encoder replica may run ahead of its backward (the
            pool holds at most this many of its embeddings); ``None``: unbounded.
        encoder_layers / backbone_layers: layer counts of the two regions.
    """

    encoder_dp: int = 1
    backbone_pp: int = 2
    max_ahead: int | None = 2
    encoder_layers: int = 1
    backbone_layers: int = 2

    def __post_init__(self) -> None:
        if self.encoder_dp < 1 or self.backbone_pp < 1:
            raise ValueError(f"DecoupledLayout: encoder_dp and backbone_pp must be >= 1, got {self.encoder_dp}, "
                             f"{self.backbone_pp}")

    @property
    def world_size(self) -> int:
        return self.encoder_dp + self.backbone_pp

    @property
    def encoder_ranks(self) -> list[int]:
        return list(range(self.encoder_dp))

    @property
    def backbone_ranks(self) -> list[int]:
        return list(range(self.encoder_dp, self.world_size))

    def regions(self, trainable_encoder: bool = True) -> list[Region]:
        return [Region(ENCODER, self.encoder_layers, Decoupled(ranks=self.encoder_dp, max_in_flight=self.max_ahead),
                       trainable=trainable_encoder),
                Region(BACKBONE, self.backbone_layers, OneFOneB(stages=self.backbone_pp))]

    def plan(self, num_microbatches: int, trainable_encoder: bool = True) -> Plan:
        """The step's per-rank programs (validated by the runtime before it runs)."""
        return compose(self.regions(trainable_encoder), num_microbatches)

    def role(self, rank: int) -> tuple[str, int]:
        """``("vit", 0)`` for an encoder replica (its chunk is stage 0 of the encoder
        region), ``("llm", s)`` for backbone stage ``s``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"DecoupledLayout: rank {rank} outside the world of {self.world_size}")
        return (ENCODER, 0) if rank < self.encoder_dp else (BACKBONE, rank - self.encoder_dp)

    def new_groups(self) -> dict[str, Any]:
        """The encoder's and the backbone's process groups (collective over the world:
        every rank calls it, in the same order)."""
        import torch.distributed as dist

        return {ENCODER: dist.new_group(self.encoder_ranks), BACKBONE: dist.new_group(self.backbone_ranks)}
