"""A flow plan's compute costs from its samples, for :func:`mindspeed_flow.schedule.simulate`.

A flow plan's groups are an encoder batch or an LLM microbatch (:mod:`.plan`), and each
costs what its samples cost on its side: an encoder batch :meth:`.EncoderCost.cost` of its
samples' patches, a microbatch :meth:`CostModel.cost` of its samples' LLM token counts (for
the whole backbone; each pipeline stage takes its share of the layers, as for every plan).
So the simulated step, and its Gantt chart, follow the grouping's real imbalance.
"""

from __future__ import annotations

from dataclasses import replace

from ..packing import CostModel
from ..schedule.costs import CostTable, Link, RegionCost
from ..schedule.regions import BACKBONE_REGION, ENCODER_REGION
from .encoder_cost import EncoderCost
from .grouping import FlowGrouping


def group_seconds(grouping: FlowGrouping, llm_cost: CostModel, encoder_cost: EncoderCost) -> list[float]:
    """Forward cost of every group of the flow plan of ``grouping``, in the plan's numbering:
    the encoder batches, then the LLM microbatches."""
    return ([encoder_cost.cost(grouping.metas(b)) for b in grouping.batches]
            + [llm_cost.cost([s.llm_tokens for s in grouping.metas(m)]) for m in grouping.microbatches])


def flow_costs(
    grouping: FlowGrouping,
    *,
    llm_cost: CostModel,
    encoder_cost: EncoderCost,
    encoder: RegionCost | None = None,
    backbone: RegionCost | None = None,
    link: Link | None = None,
    pool: Link | None = None,
) -> CostTable:
    """The cost table of ``compose_flow(grouping)``: each group's forward from its samples.

    ``encoder`` / ``backbone``: the regions' other costs (backward ratios, bytes); their
    ``forward`` and ``jitter`` are replaced by the per-group costs.  ``link`` / ``pool``:
    the point-to-point and pool links (default: free and instant).
    """
    seconds = group_seconds(grouping, llm_cost, encoder_cost)
    regions = {name: replace(template or RegionCost(), forward=1.0, jitter=None)
               for name, template in ((ENCODER_REGION, encoder), (BACKBONE_REGION, backbone))}

    def scale(region: str, group: int) -> float:
        return seconds[group]

    return CostTable(regions, link=link or Link(), pool=pool, microbatch_scale=scale)
