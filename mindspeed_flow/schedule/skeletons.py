"""Skeletons: how one region is laid out over ranks and in which order each rank works.

Two layouts exist.  *Sharded* skeletons (:class:`OneFOneB`, :class:`GPipe`,
:class:`Interleaved1F1B`) cut a region by layer over pipeline stages; every microbatch
visits every stage, and each stage follows a fixed, timing-independent order of forward and
backward steps (the closed forms Megatron and torch use).  *Replicated* skeletons
(:class:`Transpose`, :class:`Decoupled`) cut by microbatch: the rank owning microbatch ``m``
runs the whole region for it.  Transpose borrows the ranks of its sharded neighbour (filling
that pipeline's bubbles); Decoupled is FlowTrain's producer on ranks of its own, joined to its
neighbours through the memory pool.  How adjacent layouts talk is decided in :mod:`.seams`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Union

from .errors import ScheduleError

SHARDED = "sharded"
TRANSPOSED = "transposed"
DECOUPLED = "decoupled"

# One step of a stage's order: ("F" or "B", model chunk, microbatch).
Step = tuple[str, int, int]


@dataclass(frozen=True)
class _Sharded:
    """Common part of the layer-sharded skeletons.

    Attributes:
        stages: pipeline stages (ranks) of this skeleton.
        layers: layers per (virtual) stage, Megatron's ``pipeline_num_layers``; ``None``
            splits evenly.  Adjacent regions that share one skeleton value are cut together
            by this list (a ViT inside stage 0, as MindSpeed-MM places it).
    """

    stages: int
    layers: tuple[int, ...] | None = None
    layout: ClassVar[str] = SHARDED
    # Whether a trainable region's backward runs as two steps, input then weight
    # gradients (the zero-bubble skeletons of :mod:`.zero_bubble`).
    splits_backward: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ScheduleError(f"{type(self).__name__}: stages must be >= 1, got {self.stages}")
        if self.layers is not None:
            object.__setattr__(self, "layers", tuple(self.layers))
            if len(self.layers) != self.virtual_stages:
                raise ScheduleError(
                    f"{type(self).__name__}: layers has {len(self.layers)} entries for "
                    f"{self.virtual_stages} (virtual) stages"
                )

    @property
    def chunks(self) -> int:
        """Model chunks per rank (1 unless interleaved)."""
        return 1

    @property
    def virtual_stages(self) -> int:
        return self.stages * self.chunks

    def rank_of(self, virtual_stage: int, num_ranks: int) -> int:
        """Which of the pipeline's ``num_ranks`` ranks holds ``virtual_stage`` (round robin,
        Megatron's interleaved placement; a V-shape overrides it)."""
        return virtual_stage % num_ranks

    def virtual_stage(self, chunk: int, rank: int, num_ranks: int) -> int:
        """The virtual stage that model chunk ``chunk`` of pipeline rank ``rank`` holds."""
        return chunk * num_ranks + rank


@dataclass(frozen=True)
class OneFOneB(_Sharded):
    """One-forward-one-backward (PipeDream-flush), in Megatron's exact order."""

    def order(self, stage: int, num_stages: int, num_microbatches: int) -> list[Step]:
        """Stage ``stage`` of ``num_stages``: warm-up forwards, 1F1B pairs, cool-down."""
        warmup = min(num_stages - stage - 1, num_microbatches)
        steps: list[Step] = [("F", 0, m) for m in range(warmup)]
        for i in range(num_microbatches - warmup):
            steps += [("F", 0, warmup + i), ("B", 0, i)]
        steps += [("B", 0, m) for m in range(num_microbatches - warmup, num_microbatches)]
        return steps


@dataclass(frozen=True)
class GPipe(_Sharded):
    """All forwards, then all backwards."""

    def order(self, stage: int, num_stages: int, num_microbatches: int) -> list[Step]:
        return [("F", 0, m) for m in range(num_microbatches)] + [
            ("B", 0, m) for m in range(num_microbatches)
        ]


@dataclass(frozen=True)
class Interleaved1F1B(_Sharded):
    """Megatron's interleaved 1F1B: each rank holds ``chunks`` model chunks.

    Virtual stage ``v`` lives on rank ``v % stages``; microbatches advance in groups of
    ``stages`` (Megatron's default ``microbatch_group_size_per_vp_stage``).
    """

    chunks_per_rank: int = 2

    def __post_init__(self) -> None:
        if self.chunks_per_rank < 2:
            raise ScheduleError(
                f"Interleaved1F1B: chunks_per_rank must be >= 2, got {self.chunks_per_rank} "
                "(one chunk per rank is OneFOneB)"
            )
        super().__post_init__()

    @property
    def chunks(self) -> int:
        return self.chunks_per_rank

    def order(self, stage: int, num_stages: int, num_microbatches: int) -> list[Step]:
        if num_microbatches % num_stages:
            # Megatron refuses these too: a short last group leaves dependency bubbles
            # that its fixed order cannot wait out.
            raise ScheduleError(
                f"Interleaved1F1B: {num_microbatches} microbatches is not a multiple of "
                f"{num_stages} stages (Megatron's microbatch group size)"
            )
        table = _interleaved_table(num_microbatches, self.chunks, num_stages)
        total = len(table)
        warmup = (num_stages - stage - 1) * 2 + (self.chunks - 1) * num_stages
        warmup = min(warmup, total)

        def forward(k: int) -> Step:
            return ("F", table[k][1], table[k][0])

        def backward(k: int) -> Step:
            return ("B", self.chunks - 1 - table[k][1], table[k][0])

        steps = [forward(k) for k in range(warmup)]
        for i in range(total - warmup):
            steps += [forward(warmup + i), backward(i)]
        return steps + [backward(k) for k in range(total - warmup, total)]


def _interleaved_table(num_microbatches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """(microbatch, chunk) for each virtual microbatch id, groups of ``group`` microbatches."""
    table = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table += [(m, c) for c in range(chunks) for m in range(first, last)]
    return table


@dataclass(frozen=True, kw_only=True)
class _Replicated:
    """Common part of the microbatch-replicated skeletons.

    Attributes:
        max_in_flight: when the region has a backward pass, a rank starts the forward of
            its k-th microbatch only after the backward of its (k - max_in_flight)-th, so it
            never holds more than that many microbatches' activations (FlowTrain's bounded
            pool; ``None``: unbounded, the producer runs as far ahead as it can).
    """

    max_in_flight: int | None = None
    splits_backward: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ScheduleError(
                f"{type(self).__name__}: max_in_flight must be >= 1, got {self.max_in_flight}"
            )


READY = "ready"
PREFIX = "prefix"
PHASED = "phased"
# Orders that run every forward of a transposed region before its host pipeline starts.
AHEAD = (PREFIX, PHASED)
OWNER = "owner"
RECOMPUTE = "recompute"


@dataclass(frozen=True, kw_only=True)
class Transpose(_Replicated):
    """Mpipe's replicated layout: microbatch ``m`` runs the whole region on one rank of the
    neighbouring sharded pipeline (round robin), in the bubbles of that pipeline.

    Attributes:
        order: ``"ready"`` (default): each forward and backward of the region runs as soon
            as it is ready, interleaved with the pipeline's own steps by :mod:`.order`.
            ``"prefix"``: the order of the public Mpipe code (``ScheduleMPipeTranspose``):
            every rank first runs the forwards of all its microbatches, then hands them on
            in one block of sends; the pipeline's steps follow unchanged.
            ``"phased"``: the three-phase co-located schedule of MindSpeed-MM's
            ``--hetero-parallel`` and Megatron MIMO's co-located step: the forwards of the
            step first (as ``"prefix"``), then the pipeline on the (detached) outputs, then,
            once the pipeline's first stage has run its last step and handed every feature
            gradient back in one block, each rank's backwards of the region.  The baseline
            the other orders are measured against.
        backward: where a trainable region's backward runs.  ``"owner"`` (default): on the
            rank that ran the forward, which keeps the activations, gets the feature
            gradient back after the pipeline's first stage and all-reduces the weight
            gradients with the other replicas.  ``"recompute"`` (the public code's default
            for a trainable region): the owner keeps nothing and ships the region's *input*
            to the pipeline's first stage, which recomputes the forward and runs every
            backward there; the gradients collect on that one rank, so nothing is reduced.
            Only for a single region that starts the model and feeds its host pipeline.
    """

    order: str = READY
    backward: str = OWNER
    layout: ClassVar[str] = TRANSPOSED

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.order not in (READY, *AHEAD):
            raise ScheduleError(
                f"Transpose: order must be one of {(READY, *AHEAD)}, got {self.order!r}")
        if self.backward not in (OWNER, RECOMPUTE):
            raise ScheduleError(
                f"Transpose: backward must be {OWNER!r} or {RECOMPUTE!r}, got {self.backward!r}")
        if self.order in AHEAD and self.max_in_flight is not None:
            raise ScheduleError(
                f"Transpose: order={self.order!r} runs every forward before the pipeline starts; "
                "max_in_flight cannot bound it")
        if self.order == PHASED and self.backward == RECOMPUTE:
            raise ScheduleError(
                "Transpose: order='phased' runs each owner's backwards after the pipeline, and "
                "with backward='recompute' owners run none")
        if self.backward == RECOMPUTE and self.max_in_flight is not None:
            raise ScheduleError(
                "Transpose: max_in_flight bounds the activations an owner keeps for its "
                "backward, and with backward='recompute' owners keep none")


@dataclass(frozen=True)
class Decoupled(_Replicated):
    """FlowTrain's producer: the region runs on ``ranks`` ranks of its own, microbatch ``m``
    on rank ``m % ranks``, and hands its output to the next region through the pool."""

    ranks: int = 1
    layout: ClassVar[str] = DECOUPLED

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ranks < 1:
            raise ScheduleError(f"Decoupled: ranks must be >= 1, got {self.ranks}")


Skeleton = Union[OneFOneB, GPipe, Interleaved1F1B, Transpose, Decoupled]


def replicated_orders(owned: list[int], backwards: list[int] | None = None) -> list[list[Step]]:
    """A replicated rank's orders: its microbatches' forwards, and the backwards it runs
    (those of ``owned``, unless ``backwards`` names others: ``Transpose(backward="recompute")``
    runs every backward on one rank).

    They are two orders, not one: whether a backward should wait for later forwards (an
    encoder feeding a pipeline) or follow its forward at once (a head after it) depends on
    the neighbours, so :mod:`.order` interleaves them by readiness.
    """
    backwards = owned if backwards is None else backwards
    return [[("F", 0, m) for m in owned], [("B", 0, m) for m in backwards]]
