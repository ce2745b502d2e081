"""Placement: which rank runs which part of which region for each microbatch.

Regions with equal skeletons are merged into segments; sharded segments that the seam
table joins form one pipeline; every pipeline and every decoupled segment gets ranks of its
own, and a transposed segment borrows the ranks of the pipeline its seam rule names.  The
result answers one question for compose, the validator and the simulator alike: the
*path* of a microbatch, the ordered list of (region, stage, rank) visits it makes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .errors import ScheduleError
from .keys import BoundaryKey, BoundaryKind
from .regions import Region, backward_kinds
from .seams import P2P, seam_rule
from .skeletons import AHEAD, RECOMPUTE, SHARDED, TRANSPOSED, Skeleton


@dataclass(frozen=True)
class Visit:
    """One region's work for one microbatch on one rank.

    Attributes:
        region, stage: what runs (stage is the virtual pipeline stage; 0 if replicated).
        rank: where it runs.
        layers: how many of the region's layers this visit covers.
        share: ``layers`` as a fraction of the region (costs are given per region).
        backward: ``"B"``, ``"I"`` or ``None`` (see :func:`.regions.backward_kinds`).
        inbound: how its input arrives: ``"start"`` (first visit), ``"local"`` (same
            rank), ``"p2p"`` or ``"pool"``.
        backward_rank: where the backward runs when not on ``rank``: a transposed region
            with ``backward="recompute"`` ships its input there, and that rank recomputes
            the forward before the backward (``None``: on ``rank``, from kept activations).
    """

    region: str
    stage: int
    rank: int
    layers: int
    share: float
    backward: str | None
    inbound: str
    backward_rank: int | None = None

    @property
    def tag(self) -> str:
        return f"{self.region}.s{self.stage}"

    def key(self, kind: BoundaryKind) -> BoundaryKey:
        """The boundary key of ``kind`` at this visit (``key(ACT)``: its output)."""
        return BoundaryKey(self.region, self.stage, kind)

    @property
    def backward_on(self) -> int:
        """The rank that runs this visit's backward."""
        return self.rank if self.backward_rank is None else self.backward_rank


@dataclass(frozen=True)
class Group:
    """Ranks running one layout: a pipeline of sharded segments, or a replicated segment.

    Attributes:
        layout: the skeletons' layout.
        skeleton: the skeleton whose order the group follows (the first segment's).
        regions: the group's regions, in model order.
        ranks: its ranks (a pipeline: one per stage).
        slices: sharded only: per virtual stage, the (region, layers) it holds.
    """

    layout: str
    skeleton: Skeleton
    regions: tuple[Region, ...]
    ranks: tuple[int, ...]
    slices: tuple[tuple[tuple[str, int], ...], ...] = ()

    @property
    def recomputes(self) -> bool:
        """Whether the group's backward runs on its pipeline's first stage, recomputed
        (``Transpose(backward="recompute")``)."""
        return getattr(self.skeleton, "backward", None) == RECOMPUTE

    def owner(self, microbatch: int) -> int:
        """The rank that runs a replicated group's microbatch."""
        return self.ranks[microbatch % len(self.ranks)]


class Placement:
    """Groups with ranks, plus the microbatch paths through them."""

    def __init__(self, regions: Sequence[Region]) -> None:
        self.regions = tuple(regions)
        self.backward = backward_kinds(regions)
        segments = _segments(regions)
        self.groups = _place(_group(segments))
        self.num_ranks = 1 + max(r for g in self.groups for r in g.ranks)
        _check_transpose_options(self.groups)

    def path(self, microbatch: int) -> tuple[Visit, ...]:
        """Every visit of ``microbatch``, in model order."""
        visits: list[Visit] = []
        sizes = {r.name: r.num_layers for r in self.regions}
        previous: Group | None = None
        for group in self.groups:
            transport = None
            if previous is not None:
                where = f"seam {previous.regions[-1].name!r} -> {group.regions[0].name!r}"
                transport = seam_rule(previous.layout, group.layout, where).transport
            for region, stage, rank, layers in _group_visits(group, microbatch):
                if not visits:
                    inbound = "start"
                elif rank == visits[-1].rank and transport in (None, P2P):
                    inbound = "local"
                else:
                    inbound = transport or P2P
                visits.append(Visit(
                    region, stage, rank, layers, layers / sizes[region], self.backward[region], inbound
                ))
                transport = None
            previous = group
        first = self.groups[0]
        if first.recomputes and visits[0].backward and visits[1].rank != visits[0].rank:
            visits[0] = replace(visits[0], backward_rank=visits[1].rank)
        return tuple(visits)

    def roles(self) -> dict[int, str]:
        """A short label per rank ("vit(transposed) + llm.s0"), for charts and listings."""
        labels: dict[int, list[str]] = {r: [] for r in range(self.num_ranks)}
        for group in self.groups:
            if group.layout == SHARDED:
                for v, stage_slices in enumerate(group.slices):
                    rank = group.ranks[group.skeleton.rank_of(v, len(group.ranks))]
                    labels[rank] += [f"{name}.s{v}" for name, _ in stage_slices]
            else:
                for rank in group.ranks:
                    labels[rank] += [f"{r.name}({group.layout})" for r in group.regions]
        return {rank: " + ".join(parts) for rank, parts in labels.items()}


def _check_transpose_options(groups: list[Group]) -> None:
    """``order="prefix"`` (and ``"phased"``) runs a transposed region ahead of the pipeline it feeds, and
    ``backward="recompute"`` moves its backward to that pipeline's first stage, which
    recomputes from the model's input: the region must come right before the pipeline it
    runs on, and to recompute, be the model's first region, alone in its segment."""
    for i, group in enumerate(groups):
        prefix = getattr(group.skeleton, "order", None) in AHEAD
        if group.layout != TRANSPOSED or not (prefix or group.recomputes):
            continue
        name = group.regions[0].name
        said = f"order={group.skeleton.order!r}" if prefix else "backward='recompute'"
        if i + 1 >= len(groups) or groups[i + 1].layout != SHARDED or groups[i + 1].ranks != group.ranks:
            raise ScheduleError(
                f"transposed region {name!r}: {said} needs the sharded pipeline it runs on "
                "right after it"
            )
        if group.recomputes and (i != 0 or len(group.regions) != 1):
            raise ScheduleError(
                f"transposed region {name!r}: backward='recompute' needs a single region that "
                "starts the model (its input is what the first stage recomputes from)"
            )


def _segments(regions: Sequence[Region]) -> list[tuple[Skeleton, list[Region]]]:
    segments: list[tuple[Skeleton, list[Region]]] = []
    for region in regions:
        if segments and segments[-1][0] == region.skeleton:
            segments[-1][1].append(region)
        else:
            segments.append((region.skeleton, [region]))
    return segments


def _group(segments: list[tuple[Skeleton, list[Region]]]) -> list[Group]:
    """Join sharded segments that the seam table puts in one pipeline; ranks come later."""
    groups: list[Group] = []
    slices: list[list[tuple[tuple[str, int], ...]]] = []
    for skeleton, members in segments:
        own_slices = _slices(skeleton, members) if skeleton.layout == SHARDED else []
        if groups:
            last = groups[-1]
            where = f"seam {last.regions[-1].name!r} -> {members[0].name!r}"
            if seam_rule(last.layout, skeleton.layout, where).joins_pipeline:
                if type(last.skeleton) is not type(skeleton) or skeleton.chunks > 1:
                    raise ScheduleError(
                        f"{where}: a {type(last.skeleton).__name__} pipeline can be extended "
                        f"only by the same non-interleaved order, not {type(skeleton).__name__}"
                    )
                groups[-1] = Group(SHARDED, last.skeleton, last.regions + tuple(members), ())
                slices[-1] += own_slices
                continue
        groups.append(Group(skeleton.layout, skeleton, tuple(members), ()))
        slices.append(own_slices)
    return [
        Group(g.layout, g.skeleton, g.regions, g.ranks, tuple(s)) for g, s in zip(groups, slices)
    ]


def _slices(skeleton: Skeleton, members: list[Region]) -> list[tuple[tuple[str, int], ...]]:
    """Cut the segment's layers over its virtual stages: ``(region, layers)`` per stage."""
    total = sum(r.num_layers for r in members)
    n = skeleton.virtual_stages
    counts = skeleton.layers or tuple(total // n + (1 if v < total % n else 0) for v in range(n))
    if sum(counts) != total:
        raise ScheduleError(
            f"{type(skeleton).__name__}.layers sums to {sum(counts)} but regions "
            f"{[r.name for r in members]} have {total} layers"
        )
    remaining = [[r.name, r.num_layers] for r in members]
    result = []
    for v, count in enumerate(counts):
        stage: list[tuple[str, int]] = []
        while count > 0:
            take = min(count, remaining[0][1])
            stage.append((remaining[0][0], take))
            remaining[0][1] -= take
            count -= take
            if remaining[0][1] == 0:
                remaining.pop(0)
        if not stage:
            raise ScheduleError(f"stage {v} of {[r.name for r in members]} holds no layers")
        result.append(tuple(stage))
    return result


def _place(groups: list[Group]) -> list[Group]:
    """Give pipelines and decoupled groups new ranks, then lend transposed groups theirs."""
    ranks: list[tuple[int, ...]] = []
    next_rank = 0
    for group in groups:
        if group.layout == TRANSPOSED:
            ranks.append(())
            continue
        if group.layout == SHARDED:  # a joined pipeline has the stages of all its segments
            count = len(group.slices) // group.skeleton.chunks
        else:
            count = group.skeleton.ranks
        ranks.append(tuple(range(next_rank, next_rank + count)))
        next_rank += count
    for i, group in enumerate(groups):
        if group.layout == TRANSPOSED:
            ranks[i] = ranks[_host(groups, i)]
    return [Group(g.layout, g.skeleton, g.regions, r, g.slices) for g, r in zip(groups, ranks)]


def _host(groups: list[Group], i: int) -> int:
    """Index of the group whose ranks transposed group ``i`` runs on: the neighbour (right
    first) whose seam rule says it hosts transposed regions."""
    for j, side in ((i + 1, "right"), (i - 1, "left")):
        if 0 <= j < len(groups):
            pair = (groups[i].layout, groups[j].layout) if side == "right" else (
                groups[j].layout, groups[i].layout)
            rule = seam_rule(*pair, where=f"region {groups[i].regions[0].name!r}")
            if rule.hosts_transposed == side:
                return j
    raise ScheduleError(
        f"transposed region {groups[i].regions[0].name!r} has no sharded neighbour to run on"
    )


def _group_visits(group: Group, microbatch: int) -> list[tuple[str, int, int, int]]:
    """(region, stage, rank, layers) of one group's visits for a microbatch."""
    if group.layout == SHARDED:
        return [
            (name, v, group.ranks[group.skeleton.rank_of(v, len(group.ranks))], layers)
            for v, stage_slices in enumerate(group.slices)
            for name, layers in stage_slices
        ]
    owner = group.owner(microbatch)
    return [(r.name, 0, owner, r.num_layers) for r in group.regions]

