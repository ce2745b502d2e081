"""One step's two groupings, from sample metadata alone: the backbone's microbatches and the
encoder's batches.

FlowTrain packs *after* encoding: the backbone's microbatches are made by the LLM's cost and
the encoder's batches by the encoder's, so neither side inherits the other's grouping.

- **LLM microbatches**: as many as best-fit packing of the samples' LLM token counts into
  packs of ``capacity`` tokens needs (:func:`mindspeed_flow.packing.pack`; rounded up to a
  multiple of the replicas), or the job's count (``microbatches=``: repacking alone makes as
  few, as full microbatches as it can, which widens the pipeline's bubbles).  They are
  filled by the LLM's *cost*, not its tokens (heaviest sample first into the cheapest
  microbatch with room; best-fit's token packs, or a caller's ``candidates`` such as a job
  loader's packs, are kept only when their busiest replica costs less), then dealt over the
  data-parallel replicas and ordered for the pipeline by that cost
  (:func:`mindspeed_flow.packing.dispatch`: snake deal, swap repair, zig-zag heavy/light
  order when ``pp > 1``).  Give ``llm_cost`` the model's fitted
  :class:`~mindspeed_flow.packing.CostModel` (``scripts/calibrate_cost_model.py``): with its
  ``sum l^2`` term, equal token counts are not equal work.
- **Encoder batches**: the samples with images, in the order the backbone needs them (the
  first microbatch of every replica, then the second, ...), cut whenever the next sample would
  take the batch's encoder cost (:class:`.EncoderCost`) over ``encoder_budget``, each batch to
  the encoder replica that is free first (least cost so far), so the samples the backbone
  needs first are encoded first, or, when that leaves the busiest replica more to do, the
  dearest batches dealt first (a late heavy-tailed image would otherwise land on a replica
  as loaded as the others): each replica runs its batches in need order either way.

The result, :class:`FlowGrouping`, is frozen data; :meth:`FlowGrouping.check` refuses a
grouping that lost or repeated a sample, naming it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

from ..packing import CostModel, dispatch, pack
from .encoder_cost import EncoderCost
from .errors import GroupingError
from .meta import SampleMeta

LLM, ENCODER = "LLM microbatch", "encoder batch"


@dataclass(frozen=True)
class FlowGrouping:
    """One step's samples grouped twice; groups are tuples of sample ids, in need order.

    Attributes:
        step: the training step.
        samples: the step's samples (the loader's order).
        microbatches: the backbone's microbatches, in the order they are needed: the first
            microbatch of every data-parallel replica, then the second, ...
        microbatch_replica: the data-parallel replica of each microbatch.
        batches: the encoder's batches (samples with images only), in the order they are cut.
        batch_replica: the encoder replica of each batch.
        dp, pp: the backbone's data-parallel replicas and pipeline stages.
        encoder_replicas: the encoder's replicas.
    """

    step: int
    samples: tuple[SampleMeta, ...]
    microbatches: tuple[tuple[int, ...], ...]
    microbatch_replica: tuple[int, ...]
    batches: tuple[tuple[int, ...], ...]
    batch_replica: tuple[int, ...]
    dp: int = 1
    pp: int = 1
    encoder_replicas: int = 1

    @cached_property
    def by_id(self) -> dict[int, SampleMeta]:
        return {s.sample_id: s for s in self.samples}

    def replica_microbatches(self, replica: int) -> list[int]:
        """The microbatches (indices into :attr:`microbatches`) data-parallel replica ``replica``
        trains, in its pipeline order."""
        return [m for m, r in enumerate(self.microbatch_replica) if r == replica]

    def replica_batches(self, replica: int) -> list[int]:
        """The batches (indices into :attr:`batches`) encoder replica ``replica`` encodes, in order."""
        return [b for b, r in enumerate(self.batch_replica) if r == replica]

    def metas(self, group: Iterable[int]) -> list[SampleMeta]:
        """The metadata of a group's sample ids."""
        return [self.by_id[s] for s in group]

    def check(self, sample_ids: Iterable[int]) -> None:
        """Refuse a grouping in which a sample of ``sample_ids`` (the step's samples) is in no
        microbatch or in two, or in which a sample with images is in no encoder batch or in
        two, or that holds a sample the step does not have; the message names the sample."""
        expected = list(sample_ids)
        seen: set[int] = set()
        for s in expected:
            if s in seen:
                raise GroupingError(f"step {self.step}: sample {s} is listed twice among the step's samples")
            seen.add(s)
        with_images = [s for s in expected if s in self.by_id and self.by_id[s].patches]
        _check_once(f"step {self.step}", LLM, self.microbatches, expected)
        _check_once(f"step {self.step}", ENCODER, self.batches, with_images)


def _check_once(place: str, what: str, groups: Sequence[Sequence[int]], expected: Sequence[int]) -> None:
    """Every id of ``expected`` in exactly one of ``groups`` and nothing else; refused naming
    ``place``, the sample and ``what`` (the kind of group) otherwise."""
    where: dict[int, list[int]] = defaultdict(list)
    for g, ids in enumerate(groups):
        for s in ids:
            where[s].append(g)
    for s in expected:
        found = where.pop(s, [])
        if not found:
            raise GroupingError(f"{place}: sample {s} is in no {what} (lost)")
        if len(found) > 1:
            raise GroupingError(f"{place}: sample {s} is in {what}es {found} (repeated)")
    for s, found in where.items():
        raise GroupingError(f"{place}: sample {s} in {what} {found[0]} is not one of the step's samples")


def group_step(
    samples: Sequence[SampleMeta],
    *,
    capacity: int,
    llm_cost: CostModel,
    encoder_cost: EncoderCost,
    encoder_budget: float,
    encoder_replicas: int = 1,
    dp: int = 1,
    pp: int = 1,
    microbatches: int | None = None,
    candidates: Sequence[Sequence[Sequence[int]]] = (),
) -> FlowGrouping:
    """Group one step's ``samples`` for the backbone and for the encoder (see the module).

    Args:
        capacity: tokens per LLM microbatch.
        llm_cost: the LLM's cost of a microbatch (``a*sum(l) + b*sum(l^2)``).
        encoder_cost: the encoder's cost of a batch; ``encoder_budget`` bounds one batch's
            cost (a sample over it alone gets a batch of its own).
        encoder_replicas, dp, pp: encoder replicas; backbone data-parallel replicas and
            pipeline stages.
        microbatches: the job's microbatch count for the step (a multiple of ``dp``);
            ``None``: as many as best-fit packing needs, rounded up to a multiple of ``dp``.
        candidates: other groupings of the samples into the step's microbatches (sample ids;
            e.g. the packs a job's loader made), weighed with best-fit's and the cost fill's by
            the same rule; each must hold every sample once, in as many groups as the step has
            microbatches, each within ``capacity``.  The fill can fail where a candidate fits
            (it is greedy); then the candidates are all there is to choose from.
    """
    samples = tuple(samples)
    step = _check_samples("group_step", samples, capacity)
    _check_sizes("group_step", encoder_budget, encoder_replicas=encoder_replicas, dp=dp, pp=pp)
    if microbatches is not None and (microbatches < 1 or microbatches % dp):
        raise GroupingError(f"group_step: microbatches={microbatches} is not a positive multiple of dp={dp}")
    lengths = [s.llm_tokens for s in samples]
    packs = [list(p) for p in pack(lengths, capacity)]
    count = microbatches or -(-len(packs) // dp) * dp
    given = ([packs] if count == len(packs) else []) + \
        [_candidate(samples, c, k, count, capacity) for k, c in enumerate(candidates)]
    packs, costs, per_replica = _balanced(samples, given, count, capacity, llm_cost, dp, pp)
    needed = [(per_replica[d][k], d) for k in range(count // dp) for d in range(dp)]
    llm_groups = tuple(tuple(samples[i].sample_id for i in packs[p]) for p, _ in needed)
    batches, batch_replica = _encoder_batches(
        [samples[i] for p, _ in needed for i in packs[p] if samples[i].patches],
        encoder_cost, encoder_budget, encoder_replicas)
    return FlowGrouping(step, samples, llm_groups, tuple(d for _, d in needed), batches, batch_replica,
                        dp, pp, encoder_replicas)


def _check_sizes(caller: str, encoder_budget: float, **sizes: int) -> None:
    """Refuses (naming ``caller``) a size below 1 or an encoder budget that is not positive."""
    for name, value in sizes.items():
        if value < 1:
            raise GroupingError(f"{caller}: {name} must be >= 1, got {value}")
    if not encoder_budget > 0:
        raise GroupingError(f"{caller}: encoder_budget must be > 0, got {encoder_budget}")


def _check_samples(caller: str, samples: Sequence[SampleMeta], capacity: int) -> int:
    """The step the samples belong to; refuses (naming ``caller``) none, mixed steps,
    repeated ids, overlong."""
    if not samples:
        raise GroupingError(f"{caller}: the step has no samples")
    step, ids = samples[0].step, set()
    for s in samples:
        if s.step != step:
            raise GroupingError(f"{caller}: sample {s.sample_id} belongs to step {s.step}, not step {step}")
        if s.sample_id in ids:
            raise GroupingError(f"{caller}: sample {s.sample_id} appears twice in step {step}")
        ids.add(s.sample_id)
        if s.llm_tokens > capacity:
            raise GroupingError(f"{caller}: sample {s.sample_id} has {s.llm_tokens} LLM tokens, more than a "
                                f"microbatch's capacity of {capacity}")
    return step


def _candidate(samples: Sequence[SampleMeta], groups: Sequence[Sequence[int]], k: int, count: int,
               capacity: int) -> list[list[int]]:
    """Candidate grouping ``k`` (sample ids) as indices into ``samples``; refused, naming the
    candidate, when it has another count of microbatches, loses, repeats or adds a sample, or
    holds a microbatch over ``capacity`` tokens."""
    step = samples[0].step
    if len(groups) != count:
        raise GroupingError(f"group_step: candidate {k} has {len(groups)} microbatches, step {step} has {count}")
    _check_once(f"group_step: step {step}", f"candidate {k}'s microbatch", groups, [s.sample_id for s in samples])
    index = {s.sample_id: i for i, s in enumerate(samples)}
    indices = [[index[int(s)] for s in group] for group in groups]
    for m, group in enumerate(indices):
        tokens = sum(samples[i].llm_tokens for i in group)
        if tokens > capacity:
            raise GroupingError(f"group_step: candidate {k}'s microbatch {m} holds {tokens} LLM tokens, more than "
                                f"the capacity of {capacity}")
    return indices


def _balanced(
    samples: Sequence[SampleMeta], given: list[list[list[int]]], count: int, capacity: int,
    llm_cost: CostModel, dp: int, pp: int,
) -> tuple[list[list[int]], list[float], list[list[int]]]:
    """``count`` microbatches dealt over the replicas, balanced by the LLM's cost.

    Best-fit packing (in ``given``, when it made ``count`` packs) fills microbatches by
    tokens, and equal tokens are not equal work: a pack holding one long sample costs far
    more than one of many short samples (attention's ``sum l^2``).  So the microbatches are
    also filled by cost (:func:`_fill`), and the candidate whose busiest replica costs least
    is kept (then the one whose dearest microbatch, which the pipeline's ramp waits on,
    costs least; the first of ``given`` on ties: best-fit's, then the caller's).  Returns
    the microbatches, their costs and :func:`~mindspeed_flow.packing.dispatch`'s deal."""
    candidates = list(given)
    try:
        candidates.append(_fill(samples, count, capacity, llm_cost))
    except GroupingError:
        if not candidates:  # best-fit made another count and none was given: only the fill can make this one
            raise
    best = None
    for packs in candidates:
        costs = [llm_cost.cost([samples[i].llm_tokens for i in p]) for p in packs]
        per_replica = dispatch(costs, dp, pp)
        key = (max(sum(costs[p] for p in mine) for mine in per_replica), max(costs))
        if best is None or _less(key, best[0]):
            best = (key, packs, costs, per_replica)
    return best[1], best[2], best[3]


def _less(key: tuple[float, ...], other: tuple[float, ...]) -> bool:
    """``key < other``, element by element, with costs equal up to rounding taken as equal:
    with one replica every candidate's busiest replica is the step's whole cost, the same sum
    added in another order, and its last bits must not decide (the dearest microbatch must)."""
    for a, b in zip(key, other):
        if not math.isclose(a, b, rel_tol=1e-9):
            return a < b
    return False


def _fill(samples: Sequence[SampleMeta], count: int, capacity: int, llm_cost: CostModel) -> list[list[int]]:
    """``count`` microbatches balanced by LLM cost: heaviest sample first, each into the
    cheapest microbatch with room (fewer samples on ties, so none stays empty)."""
    if count > len(samples):
        raise GroupingError(f"group_step: {count} microbatches need at least {count} samples, "
                            f"step {samples[0].step} has {len(samples)}")
    groups: list[list[int]] = [[] for _ in range(count)]
    loads, tokens = [0.0] * count, [0] * count
    for i in sorted(range(len(samples)), key=lambda i: (-samples[i].llm_tokens, i)):
        length = samples[i].llm_tokens
        fits = [k for k in range(count) if tokens[k] + length <= capacity]
        if not fits:
            raise GroupingError(
                f"group_step: sample {samples[i].sample_id} ({length} tokens) fits none of {count} microbatches "
                f"of {capacity} tokens ({sum(s.llm_tokens for s in samples)} tokens in step {samples[i].step}); "
                "ask for more microbatches")
        k = min(fits, key=lambda k: (loads[k], len(groups[k]), k))
        groups[k].append(i)
        tokens[k] += length
        loads[k] = llm_cost.cost([samples[j].llm_tokens for j in groups[k]])
    return groups


def _encoder_batches(
    needed: Sequence[SampleMeta], encoder_cost: EncoderCost, budget: float, replicas: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """Cut the samples (in need order) into batches within ``budget`` and deal them over the
    replicas (:func:`_deal`)."""
    batches: list[list[SampleMeta]] = []
    for meta in needed:
        if batches and encoder_cost.cost([*batches[-1], meta]) <= budget:
            batches[-1].append(meta)
        else:
            batches.append([meta])
    owners = _deal([encoder_cost.cost(batch) for batch in batches], replicas)
    return tuple(tuple(s.sample_id for s in b) for b in batches), owners


def _deal(costs: Sequence[float], replicas: int) -> tuple[int, ...]:
    """The replica of each batch: in need order, each to the replica with the least cost so
    far (lowest index on ties), unless dealing the dearest batches first (each to the least
    loaded replica) leaves the busiest replica less to do.

    A step has few batches and a heavy-tailed image can make one of them several times the
    others; dealt in need order, such a batch that comes late lands on a replica already
    as loaded as the rest, and that replica's forwards (and, trainable, its backwards: twice
    as long) bound the step.  Dealt dearest first, the busiest replica exceeds the least
    loaded one by at most its own cheapest batch.  Each replica still runs its batches in
    need order."""
    def busiest(owners: Sequence[int]) -> float:
        loads = [0.0] * replicas
        for owner, cost in zip(owners, costs):
            loads[owner] += cost
        return max(loads)

    return min((_least_loaded(costs, range(len(costs)), replicas),
                _least_loaded(costs, sorted(range(len(costs)), key=lambda b: (-costs[b], b)), replicas)),
               key=busiest)


def _least_loaded(costs: Sequence[float], order: Iterable[int], replicas: int) -> tuple[int, ...]:
    """The replica of each batch when the batches, taken in ``order``, each go to the
    replica with the least cost so far (lowest index on ties)."""
    loads = [0.0] * replicas
    owners = [0] * len(costs)
    for b in order:
        owners[b] = min(range(replicas), key=lambda r: (loads[r], r))
        loads[owners[b]] += costs[b]
    return tuple(owners)
