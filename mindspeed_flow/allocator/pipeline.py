"""Pipeline step time and bubble, taken from the schedule simulator.

The allocator and the schedule package must agree on what a pipeline layout costs, so a
pipeline's step is :func:`mindspeed_flow.schedule.simulate` run on the program
:func:`mindspeed_flow.schedule.compose` derives for it.  A :class:`PipelineLayout` is a
run of regions cut by one shared 1F1B skeleton: the backbone's transformer layers and its
LM head (the head on the last stage, like Megatron's output layer), or, for the
Megatron-style baseline, the ViT, the layers and the head with the ViT inside stage 0.

Composed plans are cached per (layout, microbatches); simulated steps per (layout,
microbatches, costs).  Long steps are not composed in full: once every stage is in its
steady state a 1F1B step grows by the same amount per extra microbatch, so the step of
``m`` microbatches is read off two simulated steps (``cap`` and ``cap + stages``
microbatches) and extended along their line.  The tests check this against simulating
all ``m`` microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

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
    """One simulated (or extended) step: time, idle share, microbatches held per stage."""

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


@lru_cache(maxsize=8192)
def simulated(layout: PipelineLayout, microbatches: int, costs: tuple[RegionCost, ...], link: Link) -> PipelineStep:
    """Simulate all ``microbatches``; ``costs`` are per region, in the layout's order."""
    plan = composed(layout, microbatches)
    table = CostTable({name: cost for (name, _, _), cost in zip(layout.regions, costs)}, link=link)
    result = simulate(plan, table)
    return PipelineStep(result.step_time, result.bubble_fraction,
                        tuple(result.peak_live[r] for r in sorted(result.peak_live)))


def steady_state_cap(stages: int) -> int:
    """Microbatches simulated in full before a step is extended along its line."""
    return stages + 1


def pipeline_step(layout: PipelineLayout, microbatches: int, costs: tuple[RegionCost, ...],
                  link: Link) -> PipelineStep:
    """The step of ``microbatches`` microbatches: simulated, or extended beyond the cap."""
    stages = layout.stages
    cap = steady_state_cap(stages)
    if microbatches <= cap + stages:
        return simulated(layout, microbatches, costs, link)
    near = simulated(layout, cap, costs, link)
    far = simulated(layout, cap + stages, costs, link)
    extra = microbatches - (cap + stages)
    step = far.step_time + extra * (far.step_time - near.step_time) / stages
    busy = (1 - far.bubble_fraction) * far.step_time  # mean busy seconds per rank
    busy_per_microbatch = (busy - (1 - near.bubble_fraction) * near.step_time) / stages
    busy += extra * busy_per_microbatch
    return PipelineStep(step, 1 - busy / step, far.peak_live)
