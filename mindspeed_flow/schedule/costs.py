"""Cost model for the simulator: compute time per action, bytes per transfer, link speed.

Costs are given per region and per microbatch for the whole region on one rank; a visit
that holds part of a region costs its share of the layers.  Encoder time varies by
microbatch (:class:`Jitter`), and per-microbatch LLM cost can follow the packing cost model
through ``microbatch_scale`` (see :func:`pack_scale`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

from .actions import COLLECTIVES, Action, Kind
from .errors import ScheduleError
from .keys import BoundaryKind
from .placement import Visit


@dataclass(frozen=True)
class Jitter:
    """A region's forward time per microbatch: uniform in ``[low, high]`` seconds, except a
    spike of ``spike`` seconds with probability ``spike_prob``; the same seed gives the same
    times (the Mpipe seed paper: encoder microbatches normally 200-300 ms, spikes over 1000 ms)."""

    low: float
    high: float
    spike_prob: float = 0.0
    spike: float = 0.0
    seed: int = 0

    @property
    def mean(self) -> float:
        return (1 - self.spike_prob) * (self.low + self.high) / 2 + self.spike_prob * self.spike

    def sample(self, microbatch: int) -> float:
        """The forward time of ``microbatch``, seeded by (seed, microbatch) so it does not
        depend on the order in which the simulator asks."""
        rng = random.Random(f"{self.seed}:{microbatch}")
        if rng.random() < self.spike_prob:
            return self.spike
        return rng.uniform(self.low, self.high)


_POINT_TO_POINT = frozenset({Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD})


@dataclass(frozen=True)
class Link:
    """Time to move bytes: ``latency + bytes / bandwidth`` (bytes per second).

    ``post``: seconds a rank itself spends on each point-to-point send or receive it runs
    (posting the send, completing the receive: a runtime's handshake and bookkeeping), on
    top of the transfer's time: a sender goes on that much after posting, a receiver has
    the tensor that much after it arrived or after it asked, whichever is later.  Only
    the point-to-point link's counts (not the pool's, whose ``latency`` is a get's whole
    fixed cost)."""

    latency: float = 0.0
    bandwidth: float = math.inf
    post: float = 0.0

    def seconds(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class RegionCost:
    """One region's costs per microbatch, for the whole region on one rank.

    Attributes:
        forward: forward seconds (ignored when ``jitter`` is set).
        backward_ratio: full backward time over forward time.
        input_grad_ratio: input-gradient backward (a frozen region's whole backward, the first
            half of a split one) over forward time; the weight-gradient half of a split
            backward takes ``backward_ratio - input_grad_ratio``.
        output_bytes: bytes of the activations leaving any stage of the region.
        input_bytes: bytes of the region's input (pixels of a ViT), shipped to where a
            ``Transpose(backward="recompute")`` backward recomputes the forward.
        stored_bytes: activations kept for the backward pass.
        param_bytes: parameters (broadcast, gradient reduce of replicated regions).
        jitter: per-microbatch forward time, for an encoder whose load varies.
        overhead: fixed seconds every forward or backward action of the region pays on top
            of its scaled compute, whatever the microbatch (the runtime's per-action work:
            the executor's bookkeeping, the forward step's Python, a kernel launch); not
            scaled by ``microbatch_scale`` nor by a stage's share of the region.
    """

    forward: float = 0.0
    backward_ratio: float = 2.0
    input_grad_ratio: float = 1.0
    output_bytes: float = 0.0
    input_bytes: float = 0.0
    stored_bytes: float = 0.0
    param_bytes: float = 0.0
    jitter: Jitter | None = None
    overhead: float = 0.0


@dataclass(frozen=True)
class CostTable:
    """Costs of every region plus the links.

    Attributes:
        regions: region name -> its costs.
        link: point-to-point link between ranks.
        pool: link used by pool gets (default: ``link``).
        microbatch_scale: ``(region, microbatch) -> factor`` on compute time: the hook for
            the packing cost model, whose packs differ in cost.
        sample_bytes: ``sample -> bytes`` of a flow plan's per-sample pool entry (``smp``
            actions): a per-sample get then takes the pool link's time for that sample's
            bytes (its ``latency`` the fixed cost of one transfer) instead of the region's
            ``output_bytes``.  A ``taken`` notice (the in-flight window) carries nothing.
    """

    regions: Mapping[str, RegionCost]
    link: Link = field(default_factory=Link)
    pool: Link | None = None
    microbatch_scale: Callable[[str, int], float] | None = None
    sample_bytes: Callable[[int], float] | None = None

    def nominal(self) -> CostTable:
        """The same table with every jitter replaced by its mean and no per-microbatch
        scale: what a schedule can know before the step runs (for :func:`.compose`)."""
        return CostTable(
            regions={
                name: replace(c, forward=c.jitter.mean, jitter=None) if c.jitter else c
                for name, c in self.regions.items()
            },
            link=self.link,
            pool=self.pool,
            sample_bytes=self.sample_bytes,
        )

    def region(self, name: str) -> RegionCost:
        try:
            return self.regions[name]
        except KeyError:
            raise ScheduleError(f"cost table has no entry for region {name!r}") from None

    def compute_seconds(self, action: Action, visit: Visit) -> float:
        """Time of a forward or backward action at a visit."""
        cost = self.region(action.region)
        m = action.microbatch
        base = cost.jitter.sample(m) if cost.jitter else cost.forward
        if self.microbatch_scale is not None:
            base *= self.microbatch_scale(action.region, m)
        ratio = {Kind.FORWARD: 1.0, Kind.BACKWARD: cost.backward_ratio,
                 Kind.BACKWARD_INPUT: cost.input_grad_ratio,
                 Kind.BACKWARD_WEIGHT: cost.backward_ratio - cost.input_grad_ratio}[action.kind]
        if action.kind is not Kind.FORWARD and visit.backward_rank is not None:
            ratio += 1.0  # the backward runs away from its forward: the forward is recomputed
        return base * ratio * visit.share + cost.overhead

    def transfer_seconds(self, action: Action) -> float:
        """Time of a receive, a pool get, or a collective over its group."""
        # A transfer carries the output (or its gradient) of the region named by its key.
        name = action.region if action.kind in COLLECTIVES else action.key.region
        cost = self.region(name)
        if action.kind is Kind.PARAM_BROADCAST:
            return self.link.seconds(cost.param_bytes)
        if action.kind is Kind.GRAD_REDUCE:  # ring all-reduce
            n = len(action.group)
            return self.link.seconds(2 * (n - 1) / n * cost.param_bytes)
        if action.carries is BoundaryKind.TAKEN:
            return 0.0
        if action.kind is Kind.POOL_GET and action.sample is not None and self.sample_bytes is not None:
            return (self.pool or self.link).seconds(self.sample_bytes(action.sample))
        if action.kind is Kind.POOL_GET and self.pool is not None:
            return self.pool.seconds(cost.output_bytes)
        if action.carries is BoundaryKind.INPUT:
            return self.link.seconds(cost.input_bytes)
        return self.link.seconds(cost.output_bytes)

    def post_seconds(self, action: Action) -> float:
        """A rank's own time on one of its transfers (``Link.post``): point-to-point sends and
        receives only (a pool get's fixed cost is the pool link's ``latency``)."""
        return self.link.post if action.kind in _POINT_TO_POINT else 0.0

    def stored_bytes(self, visit: Visit) -> float:
        return self.region(visit.region).stored_bytes * visit.share


def pack_scale(pack_costs: Mapping[str, Sequence[float]]) -> Callable[[str, int], float]:
    """A ``microbatch_scale`` from per-microbatch costs, e.g. the packing cost model's
    ``a*sum(l) + b*sum(l^2)`` of each pack: each region's costs are divided by their mean,
    so ``RegionCost.forward`` stays the mean time and packs spread around it."""
    means = {region: sum(c) / len(c) for region, c in pack_costs.items() if c}

    def scale(region: str, microbatch: int) -> float:
        if region not in means:
            return 1.0
        costs = pack_costs[region]
        return costs[microbatch % len(costs)] / means[region]

    return scale
