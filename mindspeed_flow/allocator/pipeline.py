"""Pipeline step time and bubble, taken from the schedule simulator.

The allocator and the schedule package must agree on what a pipeline layout costs, so a
pipeline's step is :func:`mindspeed_flow.schedule.simulate` run on the program
:func:`mindspeed_flow.schedule.compose` derives for it.  A :class:`PipelineLayout` is a
run of regions cut by one shared 1F1B skeleton: the backbone's transformer layers and its
LM head (the head on the last stage, like Megatron's output layer), or, for the
Megatron-style baseline, the ViT, the layers and the head with the ViT inside stage 0.

Composed plans are cached per (layout, microbatches); simulated steps per (layout,
microbatches, costs).  Long steps are not composed in full: from ``stages`` microbatches
on, a compute-bound 1F1B step grows by the same amount per extra microbatch, so the step of
``m > 3 stages`` microbatches is read off the line through the simulated steps at
``stages`` and ``2 stages`` microbatches, once a third simulated step (``3 stages``)
confirms the line; otherwise all ``m`` are simulated.  The tests check this against
simulating all ``m`` microbatches, compute-bound and transfer-bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from mindspeed_flow.schedule import CostTable, Link, OneFOneB, Plan, Region, RegionCost, compose, simulate

LAYERS_REGION = "layers"
HEAD_REGION = "head"


@dataclass(frozen=True)
class PipelineLayout:
    """Regions ``(name, layers, trainable)`` in model order, cut over stages by ``split``
    (layers per stage, counted over all regions together)."""

    regions: tuple[tuple[str, int, bool], ...]
    split: tuple[int, ...]

    @property
    def stages(self) -> int:
        return len(self.split)


@dataclass(frozen=True)
class PipelineStep:
    """One simulated (or extended) step: time, idle share, and ``peak_live``: the most
    microbatches whose activations a stage holds at once (see :func:`in_flight`)."""

    step_time: float
    bubble_fraction: float
    peak_live: tuple[int, ...]


def uniform_split(layers: int, stages: int) -> tuple[int, ...]:
    return (layers // stages,) * stages


def backbone_layout(layers: int, stages: int, trainable: bool) -> PipelineLayout:
    """The backbone alone: layers split evenly, the LM head after the last stage's layers."""
    split = uniform_split(layers, stages)
    return PipelineLayout(((LAYERS_REGION, layers, trainable), (HEAD_REGION, 1, trainable)),
                          split[:-1] + (split[-1] + 1,))


@lru_cache(maxsize=512)
def composed(layout: PipelineLayout, microbatches: int) -> Plan:
    skeleton = OneFOneB(stages=layout.stages, layers=layout.split)
    return compose([Region(name, layers, skeleton, trainable=trainable)
                    for name, layers, trainable in layout.regions], microbatches)


def stored_regions(layout: PipelineLayout) -> tuple[int, ...]:
    """Per stage, how many trainable regions (ViT, LLM layers, head) have layers on it:
    the regions whose activations the stage keeps for a backward."""
    out, start = [], 0
    for count in layout.split:
        held, taken = 0, 0
        for _, layers, trainable in layout.regions:
            held += int(trainable and max(start, taken) < min(start + count, taken + layers))
            taken += layers
        out.append(held)
        start += count
    return tuple(out)


def in_flight(layout: PipelineLayout, peak_visits: tuple[int, ...]) -> tuple[int, ...]:
    """Microbatches in flight per stage from the simulator's ``peak_live``, which counts
    region *visits*: a microbatch on a stage holding ViT and LLM layers (or LLM layers and
    the head) is two visits.  The memory model charges every part of a stage its own
    per-microbatch activations times the microbatches in flight, so each part must be
    counted once per microbatch, not once per visit.  A 1F1B stage runs a microbatch's
    region forwards back to back and frees them in one backward, so at its peak every
    microbatch in flight holds all ``r`` stored regions of the stage: visits = ``r`` x
    microbatches, hence ``ceil(visits / r)`` (a partly visited microbatch would round up,
    never under-charge)."""
    return tuple(-(-visits // regions) if regions else 0
                 for visits, regions in zip(peak_visits, stored_regions(layout)))


@lru_cache(maxsize=8192)
def simulated(layout: PipelineLayout, microbatches: int, costs: tuple[RegionCost, ...], link: Link) -> PipelineStep:
    """Simulate all ``microbatches``; ``costs`` are per region, in the layout's order."""
    plan = composed(layout, microbatches)
    table = CostTable({name: cost for (name, _, _), cost in zip(layout.regions, costs)}, link=link)
    result = simulate(plan, table)
    return PipelineStep(result.step_time, result.bubble_fraction,
                        in_flight(layout, tuple(result.peak_live[r] for r in sorted(result.peak_live))))


def planned_live(stages: int, microbatches: int) -> tuple[int, ...]:
    """Microbatches in flight per stage of a 1F1B pipeline, ``min(stages - s,
    microbatches)`` on stage ``s``, known before simulating.  ``OneFOneB`` orders stage
    ``s`` as ``min(stages - s - 1, microbatches)`` warm-up forwards, then one more forward
    before its first backward, so the stage holds this many microbatches at that moment:
    the simulator (which counts held activations in program order) never reports fewer
    (:func:`in_flight`), and with nothing but forward/backward pairs after it never more
    (``test_planned_live_is_the_simulated_in_flight``).  Used to choose co-located splits
    and to reject backbones over memory without simulating them.  ``microbatches`` may be
    a numpy array (one entry per replica count); each stage's entry is then an array."""
    if isinstance(microbatches, np.ndarray):
        return tuple(np.minimum(stages - s, microbatches) for s in range(stages))
    return tuple(min(stages - s, microbatches) for s in range(stages))


@lru_cache(maxsize=4096)  # the pools ask again for every replica count of a shape
def stage_seconds(layout: PipelineLayout, costs: tuple[RegionCost, ...], with_backward: bool) -> tuple[float, ...]:
    """Compute seconds per microbatch of each stage: its layers at their region's per-layer
    time (forward, plus the backward of trainable regions when asked)."""
    out, start = [], 0
    for count in layout.split:
        seconds, taken = 0.0, 0
        for (_, layers, trainable), cost in zip(layout.regions, costs):
            overlap = max(0, min(start + count, taken + layers) - max(start, taken))
            factor = 1 + (cost.backward_ratio if with_backward and trainable else 0.0)
            seconds += overlap * cost.forward / layers * factor
            taken += layers
        out.append(seconds)
        start += count
    return tuple(out)


def step_lower_bound(layout: PipelineLayout, costs: tuple[RegionCost, ...], microbatches: int) -> float:
    """No schedule of this layout is shorter: stage ``s`` cannot start before the first
    microbatch's forward has passed the stages before it, then does all its own work, and
    the last microbatch's backward must still pass back through those stages; so the step
    is at least ``max_s (sum_{t<s} work_t + microbatches * work_s)`` (transfers taken as
    free).  Used to skip simulating configs that cannot matter, never as a cost."""
    work = stage_seconds(layout, costs, with_backward=True)
    return max(sum(work[:s]) + microbatches * work[s] for s in range(len(work)))


TRANSFER_SHARE = 0.05  # transfers below this share of a stage's forward: compute-bound


def steady_line(layout: PipelineLayout, costs: tuple[RegionCost, ...],
                link: Link) -> tuple[PipelineStep, PipelineStep] | None:
    """Simulated steps at ``stages`` and ``2 stages`` microbatches when the step grows
    linearly from there, else None.  Only a compute-bound pipeline (every transfer under
    ``TRANSFER_SHARE`` of the lightest stage's forward) is read off a line, and the line is
    checked against a third simulated step (``3 stages``); a transfer-bound pipeline need
    not settle into a per-microbatch rhythm and is simulated in full."""
    stages = layout.stages
    lightest = min(stage_seconds(layout, costs, with_backward=False))
    if max(link.seconds(c.output_bytes) for c in costs) > TRANSFER_SHARE * lightest:
        return None
    near, far, check = (simulated(layout, k * stages, costs, link) for k in (1, 2, 3))
    busy = [(1 - s.bubble_fraction) * s.step_time for s in (near, far, check)]
    if abs(2 * far.step_time - near.step_time - check.step_time) > 1e-9 * check.step_time \
            or abs(2 * busy[1] - busy[0] - busy[2]) > 1e-9 * busy[2]:
        return None
    return near, far


def pipeline_step(layout: PipelineLayout, microbatches: int, costs: tuple[RegionCost, ...],
                  link: Link) -> PipelineStep:
    """The step of ``microbatches`` microbatches: simulated, or read off the steady line."""
    stages = layout.stages
    # Up to 3 stages' worth, one full simulation costs no more than checking the line.
    line = steady_line(layout, costs, link) if microbatches > 3 * stages else None
    if line is None:
        return simulated(layout, microbatches, costs, link)
    near, far = line
    extra = microbatches - stages
    step = near.step_time + extra * (far.step_time - near.step_time) / stages
    busy_near = (1 - near.bubble_fraction) * near.step_time  # mean busy seconds per rank
    busy = busy_near + extra * ((1 - far.bubble_fraction) * far.step_time - busy_near) / stages
    return PipelineStep(step, 1 - busy / step, far.peak_live)
