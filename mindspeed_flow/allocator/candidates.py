"""The configs the MILP chooses from, and why the others were left out.

A candidate is one module config including its replica count: encoder (tp, dp), backbone
(tp, pp, micro batch, dp).  A config is left out, with the constraint and the amount it
misses by, when it breaks:

- ``tp-in-node``: a TP group must sit inside one node and tile it (``devices_per_node % tp``);
- ``heads/tp``: attention heads and key/value groups must divide over TP;
- ``layers/pp``: backbone layers must divide over pipeline stages;
- ``batch/dp``: the global batch must divide into ``dp x micro batch`` (Megatron's rule)
  for the backbone, into ``dp x encoder micro batch`` for the encoder;
- ``devices``: one module alone must fit the device budget;
- ``memory``: the fullest device must fit (``memory.py``, activations from the simulator;
  backbones are checked before simulating with the microbatches 1F1B holds in flight).

The replica counts tried are the divisors of the global batch (over the micro batch) that
fit the budget, which is every count the batch rule allows.  Backbone candidates are
simulated lazily (:class:`LazyPool`): the simulation is the expensive part.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable, Iterator

import numpy as np

from .pipeline import planned_live
from .proxy import BackboneEstimate, EncoderEstimate, ProxyModel
from .specs import GIB, ClusterSpec, ModuleSpec, Workload


@dataclass(frozen=True)
class Rejection:
    """A config left out: which constraint, what it needs against what is allowed."""

    module: str
    config: str
    constraint: str
    needed: float
    allowed: float
    unit: str = ""
    at_least: bool = False  # ``needed`` is a lower bound (memory before simulating)

    def describe(self) -> str:
        if self.unit == "GiB":
            amounts = f"needs {'at least ' if self.at_least else ''}{self.needed / GIB:.1f} GiB per device, limit {self.allowed / GIB:.1f} GiB " \
                      f"(over by {(self.needed - self.allowed) / GIB:.1f} GiB)"
        else:
            amounts = f"{self.needed:g} vs {self.allowed:g}{' ' + self.unit if self.unit else ''}"
        return f"{self.module} {self.config}: {self.constraint}: {amounts}"


@dataclass
class CandidateSet:
    """The surviving candidates of both modules, and every rejection."""

    encoders: list[EncoderEstimate]
    backbones: list[BackboneEstimate]
    rejections: list[Rejection]


@lru_cache(maxsize=256)
def _divisors(n: int) -> tuple[int, ...]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order (pairs up to ``sqrt n``: the global batch
    of a 16384-device job has ~15000 candidates below it, and this runs per config)."""
    return list(_divisors(n))


def _tp_rejection(module: str, spec: ModuleSpec, tp: int, cluster: ClusterSpec) -> Rejection | None:
    if tp > cluster.devices_per_node or cluster.devices_per_node % tp:
        return Rejection(module, f"tp {tp}", "tp-in-node", tp, cluster.devices_per_node, "devices per node")
    if spec.heads % tp or spec.query_groups % tp:
        return Rejection(module, f"tp {tp}", "heads/tp", spec.heads, tp, "heads over TP")
    return None


def _replicas(module: str, config: str, per_replica_devices: int, batch_units: int,
              cluster: ClusterSpec, rejections: list[Rejection]) -> Iterator[int]:
    """Replica counts allowed by the batch rule and the budget (a rejection if none)."""
    if per_replica_devices > cluster.devices:
        rejections.append(Rejection(module, config, "devices", per_replica_devices, cluster.devices, "devices"))
        return
    if batch_units < 1:
        rejections.append(Rejection(module, config, "batch/dp", 1, batch_units, "microbatches in the global batch"))
        return
    for dp in divisors(batch_units):
        if dp * per_replica_devices <= cluster.devices:
            yield dp


def encoder_candidates(spec: ModuleSpec, cluster: ClusterSpec, workload: Workload, proxy: ProxyModel,
                       rejections: list[Rejection]) -> list[EncoderEstimate]:
    """Every encoder (tp, dp) the TP, batch, budget and memory checks allow (each one left
    out is added to ``rejections``)."""
    out = []
    if workload.global_batch % workload.encoder_micro_batch:
        rejections.append(Rejection("encoder", f"micro batch {workload.encoder_micro_batch}", "batch/dp",
                                    workload.global_batch, workload.encoder_micro_batch, "global batch over micro batch"))
        return out
    for tp in workload.tp_choices:
        bad = _tp_rejection("encoder", spec, tp, cluster)
        if bad:
            rejections.append(bad)
            continue
        units = workload.global_batch // workload.encoder_micro_batch
        for dp in _replicas("encoder", f"tp {tp}", tp, units, cluster, rejections):
            est = proxy.encoder(spec, workload, tp, dp)
            if est.memory.total > cluster.memory_limit:
                rejections.append(Rejection("encoder", f"tp {tp} dp {dp}", "memory", est.memory.total,
                                            cluster.memory_limit, "GiB"))
                continue
            out.append(est)
    return out


@dataclass(frozen=True)
class PendingBackbone:
    """A backbone config that passed every cheap check, with its rate's upper bound and
    ``reach``: the most a decoupled plan with it can do, the bound capped by the fastest
    encoder that fits the devices it leaves (0 when none does)."""

    tp: int
    pp: int
    micro_batch: int
    dp: int
    bound: float
    reach: float

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp


class LazyPool:
    """Candidates simulated lazily, in order of their reach.

    The MILP never needs a candidate that cannot reach the throughput of a plan already
    found (it could not be part of any plan as good, see :func:`.solve.solve`), so
    candidates are simulated best ``reach`` first (the most any plan with them can do: the
    rate bound, for a backbone also capped by the encoders that fit beside it), only as far
    as a solve asks.  ``evaluate`` simulates one pending candidate and returns its estimate,
    or None (recording why) when it does not fit in memory.
    """

    def __init__(self, pending: list, evaluate: Callable[[Any], Any]) -> None:
        self.pending = sorted(pending, key=lambda p: -p.reach)
        self.evaluated: list = []
        self._evaluate_one = evaluate

    def _evaluate(self, p: Any) -> Any:
        self.pending.remove(p)
        est = self._evaluate_one(p)
        if est is not None:
            self.evaluated.append(est)
        return est

    def expand(self, threshold: float) -> int:
        """Simulate every pending candidate whose reach is ``threshold`` or more; returns how
        many fit in memory (and joined :attr:`evaluated`)."""
        added = 0
        while self.pending and self.pending[0].reach >= threshold:
            added += self._evaluate(self.pending[0]) is not None
        return added

    def expand_first(self, count: int) -> int:
        """Simulate the ``count`` candidates that reach furthest (a first set to solve)."""
        if not self.pending:
            return 0
        return self.expand(self.pending[min(count, len(self.pending)) - 1].reach)

    def best_within(self, devices: int) -> Any:
        """The fastest candidate on at most ``devices`` devices, simulating only those
        whose bound could beat the best found."""
        best = max((e for e in self.evaluated if e.devices <= devices), key=lambda e: e.rate, default=None)
        for p in sorted((p for p in self.pending if p.devices <= devices), key=lambda p: -p.bound):
            if best is not None and p.bound < best.rate:
                break
            est = self._evaluate(p)
            if est is not None and (best is None or est.rate > best.rate):
                best = est
        return best


def fastest_encoder_within(encoders: list[EncoderEstimate]) -> Callable[[int], float]:
    """``devices -> the fastest encoder rate on at most that many devices`` (0 if none)."""
    by_devices = sorted(encoders, key=lambda e: e.devices)
    sizes = [e.devices for e in by_devices]
    best = list(itertools.accumulate((e.rate for e in by_devices), max))

    def fastest(devices: int) -> float:
        fitting = bisect.bisect_right(sizes, devices)
        return best[fitting - 1] if fitting else 0.0

    return fastest


def backbone_pool(spec: ModuleSpec, cluster: ClusterSpec, workload: Workload, proxy: ProxyModel,
                  rejections: list[Rejection], encoders: list[EncoderEstimate]) -> LazyPool:
    """Backbone configs after the cheap checks, none simulated yet.  Memory is checked with
    the microbatches 1F1B holds in flight (:func:`.pipeline.planned_live`), which the
    simulator never reports fewer of: a config rejected here would be rejected after
    simulating too, so it is not simulated.  A config's reach is its rate bound capped by
    the fastest of ``encoders`` on the devices it leaves: a decoupled plan runs at the
    smaller of the two rates, so one whose reach is below a plan found is never simulated."""
    partner = fastest_encoder_within(encoders)
    pending = []
    pp_choices = workload.pp_choices or tuple(divisors(spec.layers))
    for tp in workload.tp_choices:
        bad = _tp_rejection("backbone", spec, tp, cluster)
        if bad:
            rejections.append(bad)
            continue
        for pp in pp_choices:
            if spec.layers % pp:
                rejections.append(Rejection("backbone", f"pp {pp}", "layers/pp", spec.layers, pp, "layers over stages"))
                continue
            for mbs in workload.micro_batch_choices:
                config = f"tp {tp} pp {pp} mbs {mbs}"
                if workload.global_batch % mbs:
                    rejections.append(Rejection("backbone", config, "batch/dp", workload.global_batch, mbs,
                                                "global batch over micro batch"))
                    continue
                units = workload.global_batch // mbs
                dps = np.array(list(_replicas("backbone", config, tp * pp, units, cluster, rejections)), dtype=np.int64)
                if not len(dps):
                    continue
                floors = proxy.backbone_memory(spec, workload, tp, pp, mbs, dps, planned_live(pp, units // dps)).total
                for dp, floor in zip(dps.tolist(), np.broadcast_to(floors, dps.shape).tolist()):
                    if floor > cluster.memory_limit:
                        rejections.append(Rejection("backbone", f"{config} dp {dp}", "memory", floor,
                                                    cluster.memory_limit, "GiB", at_least=True))
                        continue
                    bound = proxy.backbone_rate_bound(spec, workload, tp, pp, mbs, dp)
                    pending.append(PendingBackbone(tp, pp, mbs, dp, bound,
                                                   min(bound, partner(cluster.devices - tp * pp * dp))))

    def evaluate(p: PendingBackbone) -> BackboneEstimate | None:
        est = proxy.backbone(spec, workload, p.tp, p.pp, p.micro_batch, p.dp)
        if est.memory.total > cluster.memory_limit:
            rejections.append(Rejection("backbone", f"tp {p.tp} pp {p.pp} mbs {p.micro_batch} dp {p.dp}",
                                        "memory", est.memory.total, cluster.memory_limit, "GiB"))
            return None
        return est

    return LazyPool(pending, evaluate)


def candidates(encoder: ModuleSpec, backbone: ModuleSpec, cluster: ClusterSpec, workload: Workload,
               proxy: ProxyModel) -> tuple[CandidateSet, LazyPool]:
    """Every encoder candidate, and the backbone pool (its :attr:`~LazyPool.evaluated`
    list is the candidate set's ``backbones``, growing as the pool expands)."""
    rejections: list[Rejection] = []
    encoders = encoder_candidates(encoder, cluster, workload, proxy, rejections)
    pool = backbone_pool(backbone, cluster, workload, proxy, rejections, encoders)
    return CandidateSet(encoders, pool.evaluated, rejections), pool
