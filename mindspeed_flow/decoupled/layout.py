"""FlowTrain's decoupled layout: encoder ranks of their own produce embeddings into the
pool, backbone ranks consume them.

One world, two parallel configs (encoder DP x TP, backbone DP x TP x PP), each with its own
process groups.  A *slice* is one backbone replica with its encoder replicas:
``encoder_dp`` encoder replicas (microbatch ``m`` on replica ``m % encoder_dp``, at most
``max_ahead`` microbatches ahead of their backward) and a ``backbone_pp``-stage pipeline.
The step is the composed plan of ``<Decoupled, 1F1B>``: encoder forwards ``PUT`` their
embeddings, the first backbone stage ``GET``s each microbatch's embeddings when it needs
them (whichever replica made them), and ``PUT``s their gradients back, which the owning
replica ``GET``s for its backward; the replicas then reduce their weight gradients among
themselves only (the plan's ``REDUCE`` over the encoder replicas).  The math is synchronous
training's: same samples, same gradients; only the timing is decoupled.

Tensor parallelism: every encoder replica is ``encoder_tp`` ranks, every backbone stage
``backbone_tp`` ranks, and *every* TP rank runs the slice's plan (:meth:`executor_ranks`:
the plan's ranks at its own TP rank), so the plan's sends and the encoder's ``REDUCE`` pair
same-TP-rank peers.  Only the TP rank 0 of a group (its leader) touches the pool; it
broadcasts what it gets to its TP group (:class:`~.tensor_parallel.TensorParallelPool`).

Placement (global ranks): encoder ranks first, slice by slice, replica by replica, TP ranks
consecutive; then the backbone, slice by slice, stage by stage, TP ranks consecutive:
Megatron's ``order="tp-cp-ep-pp-dp"`` when the encoder ranks fill whole blocks of
``backbone_tp * backbone_pp`` ranks (:meth:`megatron_parallel_kwargs` checks it).
With ``backbone_dp > 1`` each slice trains its own share of the global batch
(:meth:`microbatches`) with its own pool namespace; after the step the backbone averages
its gradients over its data-parallel group (same stage and TP rank, every slice) and the
encoder over its own (same TP rank, every encoder replica) - :meth:`average_grads`.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any, NamedTuple

from ..schedule import Decoupled, OneFOneB, Region, compose
from ..schedule.plan import Plan
from ..schedule.regions import BACKBONE_REGION as BACKBONE
from ..schedule.regions import ENCODER_REGION as ENCODER

MEGATRON_ORDER = "tp-cp-ep-pp-dp"


class Role(NamedTuple):
    """What a rank runs: ``region`` (``"vit"`` or ``"llm"``), its ``stage`` in that region
    (0 for an encoder replica) and its rank in its TP group."""

    region: str
    stage: int
    tp_rank: int

    @property
    def binding(self) -> tuple[str, int]:
        """The ``(region, stage)`` key of the rank's :class:`~mindspeed_flow.runtime.Binding`."""
        return self.region, self.stage


@dataclass(frozen=True)
class DecoupledLayout:
    """Attributes:
        encoder_dp: encoder replicas (data parallel) per backbone replica.
        backbone_pp: backbone pipeline stages.
        max_ahead: microbatches an encoder replica may run ahead of its backward (the
            pool holds at most this many of its embeddings); ``None``: unbounded.
        encoder_layers / backbone_layers: layer counts of the two regions.
        backbone_dp: backbone replicas (data parallel), each a pipeline of its own.
        encoder_tp: ranks of one encoder replica's tensor-parallel group.
        backbone_tp: ranks of one backbone stage's tensor-parallel group.
    """

    encoder_dp: int = 1
    backbone_pp: int = 2
    max_ahead: int | None = 2
    encoder_layers: int = 1
    backbone_layers: int = 2
    backbone_dp: int = 1
    encoder_tp: int = 1
    backbone_tp: int = 1

    def __post_init__(self) -> None:
        sizes = {name: getattr(self, name) for name in ("encoder_dp", "encoder_tp", "backbone_pp", "backbone_tp",
                                                        "backbone_dp")}
        bad = {name: size for name, size in sizes.items() if size < 1}
        if bad:
            raise ValueError(f"DecoupledLayout: {', '.join(sizes)} must be >= 1, got {bad}")

    # ------------------------------------------------------------------ placement

    @property
    def world_size(self) -> int:
        return self.backbone_dp * (self.encoder_dp * self.encoder_tp + self.backbone_pp * self.backbone_tp)

    @property
    def encoder_ranks(self) -> list[int]:
        return list(range(self.backbone_dp * self.encoder_dp * self.encoder_tp))

    @property
    def backbone_ranks(self) -> list[int]:
        return list(range(len(self.encoder_ranks), self.world_size))

    def encoder_rank(self, replica: int, encoder_replica: int, tp_rank: int = 0) -> int:
        """Global rank of TP rank ``tp_rank`` of encoder replica ``encoder_replica`` of
        backbone replica ``replica``'s slice."""
        return (replica * self.encoder_dp + encoder_replica) * self.encoder_tp + tp_rank

    def backbone_rank(self, replica: int, stage: int, tp_rank: int = 0) -> int:
        """Global rank of TP rank ``tp_rank`` of stage ``stage`` of backbone replica ``replica``."""
        return len(self.encoder_ranks) + (replica * self.backbone_pp + stage) * self.backbone_tp + tp_rank

    def role(self, rank: int) -> Role:
        """``Role("vit", 0, t)`` for TP rank ``t`` of an encoder replica (its chunk is stage
        0 of the encoder region), ``Role("llm", s, t)`` for TP rank ``t`` of backbone stage ``s``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"DecoupledLayout: rank {rank} outside the world of {self.world_size}")
        encoders = len(self.encoder_ranks)
        if rank < encoders:
            return Role(ENCODER, 0, rank % self.encoder_tp)
        local = rank - encoders
        return Role(BACKBONE, (local // self.backbone_tp) % self.backbone_pp, local % self.backbone_tp)

    def replica(self, rank: int) -> int:
        """The backbone replica whose slice holds ``rank``."""
        self.role(rank)  # range check
        encoders = len(self.encoder_ranks)
        if rank < encoders:
            return rank // (self.encoder_dp * self.encoder_tp)
        return (rank - encoders) // (self.backbone_pp * self.backbone_tp)

    def tp_group_ranks(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s TP group (its encoder replica or backbone stage);
        the first is the group's leader, the one that talks to the pool."""
        first = rank - self.role(rank).tp_rank
        size = self.encoder_tp if rank < len(self.encoder_ranks) else self.backbone_tp
        return list(range(first, first + size))

    def replica_ranks(self, replica: int, encoder_tp_rank: int = 0, backbone_tp_rank: int = 0) -> list[int]:
        """Plan rank -> global rank of backbone replica ``replica``'s slice at the given TP
        ranks (its encoder replicas, then its pipeline stages)."""
        if not 0 <= replica < self.backbone_dp:
            raise ValueError(f"DecoupledLayout: backbone replica {replica} outside 0..{self.backbone_dp - 1}")
        return ([self.encoder_rank(replica, e, encoder_tp_rank) for e in range(self.encoder_dp)]
                + [self.backbone_rank(replica, s, backbone_tp_rank) for s in range(self.backbone_pp)])

    def pool_ranks(self, replica: int) -> list[int]:
        """The ranks of slice ``replica`` that open its pool: its encoder replicas' and its
        first backbone stage's TP leaders (the others see the pool through them)."""
        return [*self.replica_ranks(replica)[:self.encoder_dp], self.backbone_rank(replica, 0)]

    def _slice_tp_ranks(self, t: int) -> tuple[int, int]:
        """Slice ``t`` pairs encoder TP rank ``t`` with backbone TP rank ``t`` (rank 0 on the
        side with fewer TP ranks: that side talks to the other only through the pool)."""
        return (t if t < self.encoder_tp else 0), (t if t < self.backbone_tp else 0)

    def executor_ranks(self, rank: int) -> list[int]:
        """The ``ranks`` of ``rank``'s :class:`~mindspeed_flow.runtime.Executor` (plan rank
        -> global rank); ``rank``'s plan rank is its index in it."""
        return self.replica_ranks(self.replica(rank), *self._slice_tp_ranks(self.role(rank).tp_rank))

    def microbatches(self, replica: int, num_microbatches: int) -> list[int]:
        """The global batch's microbatches backbone replica ``replica`` trains (a contiguous
        share; each replica's plan numbers them 0, 1, ...)."""
        if num_microbatches % self.backbone_dp:
            raise ValueError(f"DecoupledLayout: {num_microbatches} microbatches do not split over "
                             f"backbone_dp={self.backbone_dp} replicas")
        share = num_microbatches // self.backbone_dp
        self.replica_ranks(replica)  # range check
        return list(range(replica * share, (replica + 1) * share))

    def megatron_parallel_kwargs(self) -> dict[str, Any]:
        """Arguments of Megatron's ``parallel_state.initialize_model_parallel`` that make its
        tensor- and pipeline-parallel groups this layout's backbone groups (every rank calls
        it; the encoder ranks' blocks build no backbone).  Raises ``ValueError`` when the
        encoder ranks do not fill whole ``backbone_tp * backbone_pp`` blocks."""
        block = self.backbone_tp * self.backbone_pp
        if len(self.encoder_ranks) % block:
            raise ValueError(
                f"DecoupledLayout: {len(self.encoder_ranks)} encoder ranks are not a multiple of backbone_tp * "
                f"backbone_pp = {block}: Megatron's {MEGATRON_ORDER} blocks would not be the backbone's pipelines")
        return {"tensor_model_parallel_size": self.backbone_tp, "pipeline_model_parallel_size": self.backbone_pp,
                "order": MEGATRON_ORDER}

    # ------------------------------------------------------------------ the step

    def regions(self, trainable_encoder: bool = True) -> list[Region]:
        return [Region(ENCODER, self.encoder_layers, Decoupled(ranks=self.encoder_dp, max_in_flight=self.max_ahead),
                       trainable=trainable_encoder),
                Region(BACKBONE, self.backbone_layers, OneFOneB(stages=self.backbone_pp))]

    def plan(self, num_microbatches: int, trainable_encoder: bool = True) -> Plan:
        """One slice's per-rank programs over its ``num_microbatches`` (validated by the
        runtime before it runs); plan rank ``i`` is global rank ``executor_ranks(rank)[i]``."""
        return compose(self.regions(trainable_encoder), num_microbatches)

    def new_groups(self) -> dict[str, Any]:
        """This rank's process groups (collective over the world: every rank calls it, in
        the same order):

        - ``"vit"`` every encoder rank, ``"llm"`` every backbone rank;
        - ``"tp"`` this rank's TP group (encoder replica or backbone stage);
        - ``"replica"`` the ranks of this rank's executor (:meth:`executor_ranks`);
        - ``"pool"`` its slice's :meth:`pool_ranks` (the ``group`` of a ``torch`` pool;
          ``None`` on the other ranks);
        - ``"vit_dp"`` this encoder TP rank over every encoder replica of every slice
          (``None`` on backbone ranks);
        - ``"llm_dp"`` this backbone stage and TP rank over every slice (``None`` on
          encoder ranks)."""
        import torch.distributed as dist

        rank = dist.get_rank()
        role = self.role(rank)
        groups: dict[str, Any] = {ENCODER: dist.new_group(self.encoder_ranks),
                                  BACKBONE: dist.new_group(self.backbone_ranks), "vit_dp": None, "llm_dp": None,
                                  "pool": None}
        mine = self.tp_group_ranks(rank)
        for first in [*self.encoder_ranks[::self.encoder_tp], *self.backbone_ranks[::self.backbone_tp]]:
            members = self.tp_group_ranks(first)
            group = dist.new_group(members)
            if members == mine:
                groups["tp"] = group
        executor = self.executor_ranks(rank)
        for replica in range(self.backbone_dp):
            for t in range(max(self.encoder_tp, self.backbone_tp)):
                members = self.replica_ranks(replica, *self._slice_tp_ranks(t))
                group = dist.new_group(members)
                if members == executor:
                    groups["replica"] = group
        for replica in range(self.backbone_dp):
            group = dist.new_group(self.pool_ranks(replica))
            if rank in self.pool_ranks(replica):
                groups["pool"] = group
        for t in range(self.encoder_tp):
            group = dist.new_group(self.encoder_ranks[t::self.encoder_tp])
            if role == (ENCODER, 0, t):
                groups["vit_dp"] = group
        for stage in range(self.backbone_pp):
            for t in range(self.backbone_tp):
                group = dist.new_group([self.backbone_rank(r, stage, t) for r in range(self.backbone_dp)])
                if role == (BACKBONE, stage, t):
                    groups["llm_dp"] = group
        return groups

    def average_grads(self, module: Any, groups: dict[str, Any]) -> None:
        """Make this rank's gradients the global batch's: each slice's executor scaled its
        losses by its own microbatch count and summed over its encoder replicas, so the
        backbone averages over its ``backbone_dp`` replicas and the encoder over its
        ``encoder_dp * backbone_dp`` replicas (each slice's sum counted once per replica),
        each over peers of the same TP rank (they hold the same shard), in one all-reduce
        per gradient dtype (:func:`average_coalesced`)."""
        import torch.distributed as dist

        region = self.role(dist.get_rank()).region
        group, count = ((groups["vit_dp"], self.encoder_dp * self.backbone_dp) if region == ENCODER
                        else (groups["llm_dp"], self.backbone_dp))
        average_coalesced(module.named_parameters(), group, count)


def average_coalesced(named_parameters: Iterable[tuple[str, Any]], group: Any, count: int) -> None:
    """Average the gradients of ``named_parameters`` over ``group`` (sum, then divide by
    ``count``) in one flat all-reduce per parameter dtype; every peer must agree on which
    parameters have a gradient (:func:`mindspeed_flow.flat_grads.all_reduce_flat_grads`)."""
    from mindspeed_flow.flat_grads import all_reduce_flat_grads

    all_reduce_flat_grads(named_parameters, group, divide_by=count, agree_on_missing=True)
