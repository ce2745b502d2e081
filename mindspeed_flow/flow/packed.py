"""A flow step whose LLM microbatches a job's loader made already.

:func:`~.grouping.group_step` packs the backbone's microbatches itself, from the samples'
metadata.  A job whose data loader hands each rank its packs (MindSpeed-MM's job with the
plugin's packing loader, which packs by the same metadata before any pixel is encoded, so
no embedding is needed to make them) keeps those as the backbone's microbatches: every
backbone stage reads its own copy of them (the last stage its labels), so they cannot be
regrouped on one rank alone.  Only the encoder's side is grouped here, exactly as
``group_step`` groups it: the samples with images in the order the backbone needs them, cut
by the encoder's own cost.
"""

from __future__ import annotations

from typing import Sequence

from .encoder_cost import EncoderCost
from .grouping import FlowGrouping, _check_samples, _check_sizes, _encoder_batches
from .meta import SampleMeta


def group_packed(
    samples: Sequence[SampleMeta],
    microbatches: Sequence[Sequence[int]],
    *,
    encoder_cost: EncoderCost,
    encoder_budget: float,
    encoder_replicas: int = 1,
    pp: int = 1,
) -> FlowGrouping:
    """One backbone replica's step: ``microbatches`` (sample ids, in the order the pipeline
    needs them) as its LLM microbatches, the encoder's batches cut by ``encoder_cost`` within
    ``encoder_budget`` over ``encoder_replicas``.  Every sample must be in exactly one
    microbatch (:meth:`FlowGrouping.check`, naming the sample)."""
    samples = tuple(samples)
    capacity = max((s.llm_tokens for s in samples), default=1)
    step = _check_samples("group_packed", samples, capacity)
    _check_sizes("group_packed", encoder_budget, encoder_replicas=encoder_replicas, pp=pp)
    groups = tuple(tuple(int(s) for s in mb) for mb in microbatches)
    by_id = {s.sample_id: s for s in samples}
    needed = [by_id[s] for mb in groups for s in mb if s in by_id and by_id[s].patches]
    batches, owners = _encoder_batches(needed, encoder_cost, encoder_budget, encoder_replicas)
    grouping = FlowGrouping(step, samples, groups, (0,) * len(groups), batches, owners, 1, pp, encoder_replicas)
    grouping.check(s.sample_id for s in samples)
    return grouping
