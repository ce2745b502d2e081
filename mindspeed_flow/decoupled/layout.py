"""Where a decoupled layout puts its ranks: encoder ranks of their own produce embeddings
into the pool, backbone ranks consume them.

One world, two parallel configs (encoder DP x TP, backbone DP x TP x PP), each with its own
process groups (:mod:`.groups`).  A *slice* is one backbone replica with its encoder
replicas: ``encoder_dp`` encoder replicas (microbatch ``m`` on replica ``m % encoder_dp``,
at most ``max_ahead`` microbatches ahead of their backward) and a ``backbone_pp``-stage
pipeline, which run the slice's composed plan (:mod:`.plan`).

Tensor parallelism: every encoder replica is ``encoder_tp`` ranks, every backbone stage
``backbone_tp`` ranks, and *every* TP rank runs the slice's plan (:meth:`executor_ranks`:
the plan's ranks at its own TP rank), so the plan's sends and the encoder's ``REDUCE`` pair
same-TP-rank peers.  Only the TP rank 0 of a group (its leader) touches the pool; it
broadcasts what it gets to its TP group (:class:`~mindspeed_flow.pool.tensor_parallel.TensorParallelPool`).

Placement (global ranks): encoder ranks first, slice by slice, replica by replica, TP ranks
consecutive; then the backbone, slice by slice, stage by stage, TP ranks consecutive:
Megatron's ``order="tp-cp-ep-pp-dp"`` when the encoder ranks fill whole blocks of
``backbone_tp * backbone_pp`` ranks (:meth:`megatron_parallel_kwargs` checks it).
With ``backbone_dp > 1`` each slice trains its own share of the global batch
(:meth:`microbatches`) with its own pool namespace (one pool for all under
:attr:`deals_over_slices`); after the step each role averages its
gradients over its own data-parallel replicas (:mod:`.grads`).

The sizes are the layout; the layer counts only weigh the plan's costs and come from the
model (:meth:`with_layers`), so a layout read from a file or an allocator plan is complete
before the model config is read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from ..schedule.regions import BACKBONE_REGION as BACKBONE
from ..schedule.regions import ENCODER_REGION as ENCODER
from . import grads as _grads
from . import groups as _groups
from . import plan as _plan
from .errors import LayoutError

if TYPE_CHECKING:
    from ..flow.encoder_cost import EncoderCost
    from ..schedule import Region
    from ..schedule.plan import Plan

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
        flow: FlowTrain's flow instead of the lockstep plan: the encoder encodes the step's
            samples in batches of its own and puts one pool entry per sample; the backbone
            takes each microbatch's samples by key (``mindspeed_flow.flow``).
        flow_encoder_batch_patches: under ``flow``, the ViT patches of one encoder batch
            (a sample with more gets a batch of its own); under ``flow_encoder_cost``, a
            batch may cost what one image of that many patches costs
            (:attr:`flow_encoder_budget`).
        flow_encoder_cost: under ``flow``, the encoder's cost of a batch
            (:class:`~mindspeed_flow.flow.EncoderCost`, e.g. fitted by
            ``scripts/calibrate_cost_model.py``) its batches are cut by; ``None``: patches.
        flow_max_in_flight: under ``flow``, a frozen encoder replica's pool entries put and
            not yet taken, at most, when it runs ahead into the next step (``None``: the
            pool's capacity alone bounds it; it never runs more than one step ahead).
        flow_repack: under ``flow``, the backbone's microbatches are made by the flow's scheduler
            from the step's samples (best-fit by the LLM's cost model, the job's microbatch count,
            zig-zag over the pipeline stages: :func:`mindspeed_flow.flow.group_step`) instead
            of being the data loader's packs; with several backbone replicas, the samples of
            every slice's step together, dealt over PP x DP (:attr:`deals_over_slices`).
    """

    encoder_dp: int = 1
    backbone_pp: int = 2
    max_ahead: int | None = 2
    encoder_layers: int = 1
    backbone_layers: int = 2
    backbone_dp: int = 1
    encoder_tp: int = 1
    backbone_tp: int = 1
    flow: bool = False
    flow_encoder_batch_patches: int = 1024
    flow_encoder_cost: EncoderCost | None = None
    flow_max_in_flight: int | None = None
    flow_repack: bool = False

    def __post_init__(self) -> None:
        sizes = {name: getattr(self, name) for name in ("encoder_dp", "encoder_tp", "backbone_pp", "backbone_tp",
                                                        "backbone_dp")}
        bad = {name: size for name, size in sizes.items() if size < 1}
        if bad:
            raise LayoutError(f"DecoupledLayout: {', '.join(sizes)} must be >= 1, got {bad}")
        if self.flow_encoder_batch_patches < 1:
            raise LayoutError(f"DecoupledLayout: flow_encoder_batch_patches must be >= 1, got "
                              f"{self.flow_encoder_batch_patches}")
        if self.flow_encoder_cost is not None and not self.flow_encoder_budget > 0:
            raise LayoutError(f"DecoupledLayout: flow_encoder_cost {self.flow_encoder_cost} gives an image of "
                              f"flow_encoder_batch_patches={self.flow_encoder_batch_patches} patches no cost: "
                              f"no budget to cut the encoder's batches by")
        if self.flow_max_in_flight is not None and self.flow_max_in_flight < 1:
            raise LayoutError(f"DecoupledLayout: flow_max_in_flight must be >= 1 or None, got "
                              f"{self.flow_max_in_flight}")
        if self.flow_repack and not self.flow:
            raise LayoutError("DecoupledLayout: flow_repack regroups the flow's samples: it needs flow")

    @property
    def flow_encoder_model(self) -> EncoderCost:
        """The encoder's cost its batches are cut by under ``flow``: ``flow_encoder_cost``, or
        patches when unset."""
        from ..flow.encoder_cost import PATCHES  # the flow package imports torch: only when asked

        return PATCHES if self.flow_encoder_cost is None else self.flow_encoder_cost

    @property
    def flow_encoder_budget(self) -> float:
        """What one encoder batch may cost under ``flow``: one image of
        ``flow_encoder_batch_patches`` patches under :attr:`flow_encoder_model` (with the
        default, that many patches)."""
        return self.flow_encoder_model.image_cost(self.flow_encoder_batch_patches)

    @property
    def deals_over_slices(self) -> bool:
        """Whether the flow's scheduler deals each step's samples over every backbone replica
        (``flow_repack`` with ``backbone_dp > 1``): the slices gather each other's samples,
        a sample may be encoded in one slice and trained in another, so the slices share one
        pool (one namespace) instead of a pool each."""
        return self.flow_repack and self.backbone_dp > 1

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
            raise LayoutError(f"DecoupledLayout: rank {rank} outside the world of {self.world_size}")
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
            raise LayoutError(f"DecoupledLayout: backbone replica {replica} outside 0..{self.backbone_dp - 1}")
        return ([self.encoder_rank(replica, e, encoder_tp_rank) for e in range(self.encoder_dp)]
                + [self.backbone_rank(replica, s, backbone_tp_rank) for s in range(self.backbone_pp)])

    def slice_ranks(self, replica: int) -> list[int]:
        """Every rank of backbone replica ``replica``'s slice: its encoder replicas' and its
        pipeline stages' TP ranks (one slice holds one copy of the whole model)."""
        self.replica_ranks(replica)  # range check
        return ([self.encoder_rank(replica, e, t) for e in range(self.encoder_dp) for t in range(self.encoder_tp)]
                + [self.backbone_rank(replica, s, t) for s in range(self.backbone_pp) for t in range(self.backbone_tp)])

    def pool_ranks(self, replica: int) -> list[int]:
        """The ranks of slice ``replica`` that open its pool: its encoder replicas' and its
        first backbone stage's TP leaders (the others see the pool through them)."""
        return [*self.replica_ranks(replica)[:self.encoder_dp], self.backbone_rank(replica, 0)]

    def slice_tp_ranks(self, t: int) -> tuple[int, int]:
        """Slice ``t`` pairs encoder TP rank ``t`` with backbone TP rank ``t`` (rank 0 on the
        side with fewer TP ranks: that side talks to the other only through the pool)."""
        return (t if t < self.encoder_tp else 0), (t if t < self.backbone_tp else 0)

    def executor_ranks(self, rank: int) -> list[int]:
        """The ``ranks`` of ``rank``'s :class:`~mindspeed_flow.runtime.Executor` (plan rank
        -> global rank); ``rank``'s plan rank is its index in it."""
        return self.replica_ranks(self.replica(rank), *self.slice_tp_ranks(self.role(rank).tp_rank))

    def microbatches(self, replica: int, num_microbatches: int) -> list[int]:
        """The global batch's microbatches backbone replica ``replica`` trains (a contiguous
        share; each replica's plan numbers them 0, 1, ...)."""
        if num_microbatches % self.backbone_dp:
            raise LayoutError(f"DecoupledLayout: {num_microbatches} microbatches do not split over "
                              f"backbone_dp={self.backbone_dp} replicas")
        share = num_microbatches // self.backbone_dp
        self.replica_ranks(replica)  # range check
        return list(range(replica * share, (replica + 1) * share))

    def megatron_parallel_kwargs(self) -> dict[str, Any]:
        """Arguments of Megatron's ``parallel_state.initialize_model_parallel`` that make its
        tensor- and pipeline-parallel groups this layout's backbone groups (every rank calls
        it; the encoder ranks' blocks build no backbone).  Raises :class:`~.errors.LayoutError` when the
        encoder ranks do not fill whole ``backbone_tp * backbone_pp`` blocks."""
        block = self.backbone_tp * self.backbone_pp
        if len(self.encoder_ranks) % block:
            raise LayoutError(
                f"DecoupledLayout: {len(self.encoder_ranks)} encoder ranks are not a multiple of backbone_tp * "
                f"backbone_pp = {block}: Megatron's {MEGATRON_ORDER} blocks would not be the backbone's pipelines")
        return {"tensor_model_parallel_size": self.backbone_tp, "pipeline_model_parallel_size": self.backbone_pp,
                "order": MEGATRON_ORDER}

    def check_world_size(self, world_size: int, source: str) -> None:
        """Refuse a job whose world is not this layout's, naming both numbers and where the
        layout came from (``source``: a file, a plan)."""
        if world_size != self.world_size:
            raise LayoutError(
                f"{source}: the decoupled layout needs {self.world_size} ranks (encoder {len(self.encoder_ranks)} = "
                f"{self.encoder_dp * self.backbone_dp} replicas x tp {self.encoder_tp}, backbone "
                f"{len(self.backbone_ranks)} = dp {self.backbone_dp} x pp {self.backbone_pp} x tp {self.backbone_tp}), "
                f"but the job's world size is {world_size}")

    def with_layers(self, encoder_layers: int, backbone_layers: int) -> "DecoupledLayout":
        """The same layout with the model's layer counts (they weigh the plan's costs)."""
        return replace(self, encoder_layers=encoder_layers, backbone_layers=backbone_layers)

    # ------------------------------------------------------------------ the step

    def regions(self, trainable_encoder: bool = True) -> "list[Region]":
        return _plan.regions(self, trainable_encoder)

    def plan(self, num_microbatches: int, trainable_encoder: bool = True) -> "Plan":
        """One slice's per-rank programs (:func:`.plan.slice_plan`)."""
        return _plan.slice_plan(self, num_microbatches, trainable_encoder)

    def new_groups(self) -> dict[str, Any]:
        """This rank's process groups (:func:`.groups.new_groups`; collective)."""
        return _groups.new_groups(self)

    def average_grads(self, module: Any, groups: dict[str, Any]) -> None:
        """Average ``module``'s gradients over this rank's role's replicas (:func:`.grads.average_grads`)."""
        _grads.average_grads(self, module, groups)
