"""Zero-bubble skeletons: the backward split into input-gradient and weight-gradient steps.

Zero-bubble pipelines (Qi et al., "Zero Bubble Pipeline Parallelism") split each trainable
backward ``B`` into ``I`` (input gradients, on the critical path: the previous stage waits for
them) and ``W`` (weight gradients, needed by nobody until the optimizer step), and move the
``W`` steps into the bubbles.  A frozen region on the gradient path runs ``I`` alone, as under
every other skeleton; only a *trainable* region of a splitting skeleton runs ``I`` then ``W``.

Two skeletons are offered, both layer-sharded:

- :class:`ZeroBubbleH1` (ZB-H1): one stage per rank; every stage holds at most ``p``
  microbatches until their ``W``, the peak of 1F1B's stage 0;
- :class:`ZeroBubbleV`: two model chunks per rank placed as a V (virtual stage ``v`` on rank
  ``v`` going down, on rank ``2p - 1 - v`` coming back, so the loss is on rank 0), the
  placement of DualPipeV, which MindSpeed ships, in the zero-bubble V order (ZB-V): each
  rank holds at most ``2p`` chunk activations, 1F1B's memory.  It is not DualPipeV's own
  step table, which overlaps a forward and a backward chunk in one fused step.

ZB-H1 is a closed form; the V order is the zero-bubble paper's greedy rule played out once
in unit time slots.  Either way each rank gets a fixed, timing-independent order, like every
other sharded skeleton.  With forward, input-gradient and weight-gradient steps of equal
time, ZB-H1 takes ``3m + p - 1`` steps' time against 1F1B's ``3(m + p - 1)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

from .errors import ScheduleError
from .skeletons import Step, _Sharded


@dataclass(frozen=True)
class ZeroBubbleH1(_Sharded):
    """ZB-H1: 1F1B's warm-up and memory, each backward split, ``W`` steps in the bubbles."""

    splits_backward: ClassVar[bool] = True

    def order(self, stage: int, num_stages: int, num_microbatches: int) -> list[Step]:
        """1F1B's warm-up (``p - 1 - s`` forwards), then each forward followed by the input
        gradients of the oldest microbatch; stage ``s`` holds back its first ``s`` weight
        steps, so every later one fills a slot where 1F1B's stage would wait, and runs the
        held-back ones at the end (torch.distributed.pipelining's zero-bubble rule)."""
        warmup = min(num_stages - 1 - stage, num_microbatches)
        steps: list[Step] = [("F", 0, m) for m in range(warmup)]
        weights = 0
        for m in range(num_microbatches):
            if warmup + m < num_microbatches:
                steps.append(("F", 0, warmup + m))
            steps.append(("B", 0, m))
            if m >= stage:
                steps.append(("W", 0, weights))
                weights += 1
        return steps + [("W", 0, m) for m in range(weights, num_microbatches)]


@dataclass(frozen=True)
class ZeroBubbleV(_Sharded):
    """A V-shape of two chunks per rank (DualPipeV's placement) in a zero-bubble order."""

    splits_backward: ClassVar[bool] = True

    @property
    def chunks(self) -> int:
        return 2

    def rank_of(self, virtual_stage: int, num_ranks: int) -> int:
        """Down the ranks with chunk 0, back up with chunk 1: the loss lands on rank 0."""
        return virtual_stage if virtual_stage < num_ranks else 2 * num_ranks - 1 - virtual_stage

    def virtual_stage(self, chunk: int, rank: int, num_ranks: int) -> int:
        return rank if chunk == 0 else 2 * num_ranks - 1 - rank

    def order(self, stage: int, num_stages: int, num_microbatches: int) -> list[Step]:
        return list(_v_orders(num_stages, num_microbatches)[stage])


@lru_cache(maxsize=64)
def _v_orders(num_stages: int, num_microbatches: int) -> tuple[tuple[Step, ...], ...]:
    """Every rank's V-shape order, from one play of the greedy rule in unit slots (every
    ``F``, ``I`` and ``W`` of a chunk one slot): a rank runs a ready ``I`` first (the
    critical path), else a ready ``F`` while it holds fewer than ``2p`` chunk activations
    (1F1B's peak), else its oldest pending ``W``; between its two chunks the later virtual
    stage goes first.  Phase ``"B"`` of a step is the input-gradient part (the whole
    backward of a region that does not split), ``"W"`` the weight-gradient part.
    """
    p = num_stages
    last = 2 * p - 1
    done: dict[tuple[str, int, int], int] = {}  # (phase, virtual stage, mb) -> slot it ended
    next_forward = [0] * (last + 1)
    next_backward = [0] * (last + 1)
    pending_weights: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    held = [0] * p
    orders: list[list[Step]] = [[] for _ in range(p)]
    remaining = 3 * num_microbatches * (last + 1)
    slot = 0

    def finished(phase: str, v: int, m: int) -> bool:
        return done.get((phase, v, m), slot + 1) <= slot

    while remaining:
        picks = []
        for rank in range(p):
            stages = (last - rank, rank)  # chunk 1 (nearer the loss) first
            pick = next((("B", v, next_backward[v]) for v in stages
                         if next_backward[v] < num_microbatches
                         and finished("F", v, next_backward[v])
                         and (v == last or finished("B", v + 1, next_backward[v]))), None)
            if pick is None and held[rank] < 2 * p:
                pick = next((("F", v, next_forward[v]) for v in stages
                             if next_forward[v] < num_microbatches
                             and (v == 0 or finished("F", v - 1, next_forward[v]))), None)
            if pick is None and pending_weights[rank]:
                pick = ("W",) + pending_weights[rank].pop(0)
            if pick is not None:
                picks.append((rank, pick))
        if not picks:  # every step lasts one slot: an empty slot would repeat forever
            raise ScheduleError(f"ZeroBubbleV: no rank can move at slot {slot} ({remaining} steps left)")
        for rank, (phase, v, m) in picks:
            done[(phase, v, m)] = slot + 1
            orders[rank].append((phase, v // p, m))
            if phase == "F":
                next_forward[v] += 1
                held[rank] += 1
            elif phase == "B":
                next_backward[v] += 1
                pending_weights[rank].append((v, m))
            else:
                held[rank] -= 1
            remaining -= 1
        slot += 1
    return tuple(tuple(order) for order in orders)
