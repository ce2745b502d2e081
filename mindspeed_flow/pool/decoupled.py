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

With ``backbone_dp > 1`` the world holds ``backbone_dp`` copies of that slice (encoder
ranks first, slice by slice, then the backbone stages, pipeline by pipeline, so Megatron's
``order="tp-cp-ep-pp-dp"`` finds them consecutive when ``encoder_dp * backbone_dp`` is a
multiple of ``backbone_pp``).  Backbone replica ``r`` runs the slice's plan over its own
share of the global batch (:meth:`DecoupledLayout.microbatches`) with its own pool
namespace, so ``(key, microbatch)`` names one replica's embeddings; its gradients go back
to the encoder replicas of its slice.  After the step the backbone stages average their
gradients over their data-parallel group (same stage, every replica) and the encoder ranks
over the encoder group (every encoder rank) - see :meth:`DecoupledLayout.average_grads`.
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
        encoder_dp: encoder replicas (data parallel) per backbone replica.
        backbone_pp: backbone pipeline stages.
        backbone_dp: backbone replicas (data parallel), each a pipeline of its own.
        max_ahead: microbatches an encoder replica may run ahead of its backward (the
            pool holds at most this many of its embeddings); ``None``: unbounded.
        encoder_layers / backbone_layers: layer counts of the two regions.
    """

    encoder_dp: int = 1
    backbone_pp: int = 2
    max_ahead: int | None = 2
    encoder_layers: int = 1
    backbone_layers: int = 2
    backbone_dp: int = 1

    def __post_init__(self) -> None:
        if min(self.encoder_dp, self.backbone_pp, self.backbone_dp) < 1:
            raise ValueError(f"DecoupledLayout: encoder_dp, backbone_pp and backbone_dp must be >= 1, got "
                             f"{self.encoder_dp}, {self.backbone_pp}, {self.backbone_dp}")

    @property
    def world_size(self) -> int:
        return self.backbone_dp * (self.encoder_dp + self.backbone_pp)

    @property
    def encoder_ranks(self) -> list[int]:
        return list(range(self.encoder_dp * self.backbone_dp))

    @property
    def backbone_ranks(self) -> list[int]:
        return list(range(self.encoder_dp * self.backbone_dp, self.world_size))

    def replica_ranks(self, replica: int) -> list[int]:
        """Plan rank -> global rank of backbone replica ``replica``'s slice (its encoder
        replicas, then its pipeline stages): the ``ranks`` of its :class:`Executor`."""
        if not 0 <= replica < self.backbone_dp:
            raise ValueError(f"DecoupledLayout: backbone replica {replica} outside 0..{self.backbone_dp - 1}")
        encoders = self.encoder_ranks[replica * self.encoder_dp:(replica + 1) * self.encoder_dp]
        return encoders + self.backbone_ranks[replica * self.backbone_pp:(replica + 1) * self.backbone_pp]

    def replica(self, rank: int) -> int:
        """The backbone replica whose slice holds ``rank``."""
        self.role(rank)  # range check
        if rank < len(self.encoder_ranks):
            return rank // self.encoder_dp
        return (rank - len(self.encoder_ranks)) // self.backbone_pp

    def microbatches(self, replica: int, num_microbatches: int) -> list[int]:
        """The global batch's microbatches backbone replica ``replica`` trains (a contiguous
        share; each replica's plan numbers them 0, 1, ...)."""
        if num_microbatches % self.backbone_dp:
            raise ValueError(f"DecoupledLayout: {num_microbatches} microbatches do not split over "
                             f"backbone_dp={self.backbone_dp} replicas")
        share = num_microbatches // self.backbone_dp
        self.replica_ranks(replica)  # range check
        return list(range(replica * share, (replica + 1) * share))

    def regions(self, trainable_encoder: bool = True) -> list[Region]:
        return [Region(ENCODER, self.encoder_layers, Decoupled(ranks=self.encoder_dp, max_in_flight=self.max_ahead),
                       trainable=trainable_encoder),
                Region(BACKBONE, self.backbone_layers, OneFOneB(stages=self.backbone_pp))]

    def plan(self, num_microbatches: int, trainable_encoder: bool = True) -> Plan:
        """One backbone replica's slice's per-rank programs over its ``num_microbatches``
        (validated by the runtime before it runs); plan rank ``i`` is global rank
        ``replica_ranks(r)[i]``."""
        return compose(self.regions(trainable_encoder), num_microbatches)

    def role(self, rank: int) -> tuple[str, int]:
        """``("vit", 0)`` for an encoder replica (its chunk is stage 0 of the encoder
        region), ``("llm", s)`` for backbone stage ``s``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"DecoupledLayout: rank {rank} outside the world of {self.world_size}")
        encoders = len(self.encoder_ranks)
        return (ENCODER, 0) if rank < encoders else (BACKBONE, (rank - encoders) % self.backbone_pp)

    def new_groups(self) -> dict[str, Any]:
        """This rank's process groups (collective over the world: every rank calls it, in
        the same order): ``"vit"`` every encoder rank, ``"llm"`` every backbone rank,
        ``"replica"`` this rank's slice (its executor's group), ``"llm_dp"`` this backbone
        stage over every replica (``None`` on encoder ranks)."""
        import torch.distributed as dist

        rank = dist.get_rank()
        groups = {ENCODER: dist.new_group(self.encoder_ranks), BACKBONE: dist.new_group(self.backbone_ranks)}
        for r in range(self.backbone_dp):
            group = dist.new_group(self.replica_ranks(r))
            if r == self.replica(rank):
                groups["replica"] = group
        groups["llm_dp"] = None
        for stage in range(self.backbone_pp):
            group = dist.new_group(self.backbone_ranks[stage::self.backbone_pp])
            if self.role(rank) == (BACKBONE, stage):
                groups["llm_dp"] = group
        return groups

    def average_grads(self, module: Any, groups: dict[str, Any]) -> None:
        """Make this rank's gradients the global batch's: each slice's executor scaled its
        losses by its own microbatch count and summed over its encoder replicas, so the
        backbone averages over its ``backbone_dp`` replicas and the encoder over its
        ``encoder_dp * backbone_dp`` ranks (each slice's sum counted once per replica)."""
        import torch.distributed as dist

        region, _ = self.role(dist.get_rank())
        group, count = ((groups[ENCODER], len(self.encoder_ranks)) if region == ENCODER
                        else (groups["llm_dp"], self.backbone_dp))
        for p in module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad /= count
