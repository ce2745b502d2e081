"""A flow plan's compute costs from its samples, for :func:`mindspeed_flow.schedule.simulate`.

A flow plan's groups are an encoder batch or an LLM microbatch (:mod:`.plan`), and each
costs what its samples cost on its side: an encoder batch :meth:`.EncoderCost.cost` of its
samples' patches, a microbatch :meth:`CostModel.cost` of its samples' LLM token counts (for
the whole backbone; each pipeline stage takes its share of the layers, as for every plan).
So the simulated step, and its Gantt chart, follow the grouping's real imbalance.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from ..packing import CostModel
from ..schedule.costs import CostTable, Link, RegionCost
from ..schedule.regions import BACKBONE_REGION, ENCODER_REGION
from .encoder_cost import EncoderCost
from .grouping import FlowGrouping
from .plan import StepNumbering


def group_seconds(grouping: FlowGrouping | Sequence[FlowGrouping], llm_cost: CostModel,
                  encoder_cost: EncoderCost) -> list[float]:
    """Forward cost of every group of the flow plan of ``grouping`` (or of the steps of
    :func:`.compose_flow_steps`), in the plan's numbering: each step's encoder batches, then
    its LLM microbatches."""
    return [cost for g in _steps(grouping) for cost in
            [encoder_cost.cost(g.metas(b)) for b in g.batches]
            + [llm_cost.cost([s.llm_tokens for s in g.metas(m)]) for m in g.microbatches]]


def flow_costs(
    grouping: FlowGrouping | Sequence[FlowGrouping],
    *,
    llm_cost: CostModel,
    encoder_cost: EncoderCost,
    encoder: RegionCost | None = None,
    backbone: RegionCost | None = None,
    link: Link | None = None,
    pool: Link | None = None,
    token_bytes: float = 0.0,
) -> CostTable:
    """The cost table of ``compose_flow(grouping)`` (or of ``compose_flow_steps`` of a
    sequence of groupings): each group's forward from its samples.

    ``encoder`` / ``backbone``: the regions' other costs (backward ratios, bytes); their
    ``forward`` and ``jitter`` are replaced by the per-group costs.  ``link`` / ``pool``:
    the point-to-point and pool links (default: free and instant).  ``token_bytes``: bytes
    of one image token's embedding row; given, every per-sample get costs the pool link's
    time for *that sample's* bytes (``image_tokens * token_bytes``, plus ``pool.latency``:
    the fixed cost of one transfer, which ``scripts/bench_flow.py`` measures) instead of the
    encoder region's ``output_bytes``.
    """
    steps = _steps(grouping)
    seconds = group_seconds(steps, llm_cost, encoder_cost)
    regions = {name: replace(template or RegionCost(), forward=1.0, jitter=None)
               for name, template in ((ENCODER_REGION, encoder), (BACKBONE_REGION, backbone))}

    def scale(region: str, group: int) -> float:
        return seconds[group]

    sample_bytes = None
    if token_bytes > 0:
        numbering = StepNumbering.of(steps)

        def sample_bytes(plan_sample: int) -> float:
            k, sample_id = numbering.step_of_sample(plan_sample)
            return steps[k].by_id[sample_id].image_tokens * token_bytes

    return CostTable(regions, link=link or Link(), pool=pool, microbatch_scale=scale, sample_bytes=sample_bytes)


def _steps(grouping: FlowGrouping | Sequence[FlowGrouping]) -> list[FlowGrouping]:
    return [grouping] if isinstance(grouping, FlowGrouping) else list(grouping)
