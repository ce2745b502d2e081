"""FlowTrain's flow, in the core: per-sample embeddings through the pool, the backbone's
microbatches packed after encoding.

The encoder puts one pool entry per sample (:class:`SampleMeta` as its metadata, under
:class:`SampleKey`); from that metadata alone :func:`group_step` groups a step twice, the
backbone's microbatches by the LLM's cost (best-fit packing, zig-zag dispatch over PP x DP)
and the encoder's batches by its own (:class:`EncoderCost`), in the order the backbone needs
the samples; :func:`compose_flow` makes that step a schedule :class:`~mindspeed_flow.schedule.Plan`
whose seam is the pool per sample, which ``validate`` checks sample by sample and
``simulate`` replays with :func:`flow_costs`.

The runtime: :class:`EmbeddingProducer` (an encoder replica: encode its batches, put per
sample, run the backward as gradients come back), :class:`EmbeddingConsumer` (the backbone's
first stage: take a microbatch's samples, put their gradients back), :func:`backbone_plan` /
:func:`stage_feed` (a backbone replica's 1F1B on the executor, fed from the pool) and
:class:`FlowRanks` (which rank is which).  See ``docs/flow.md`` for what is not built yet.
"""

from .backbone import backbone_plan, stage_feed
from .consumer import ConsumerStats, EmbeddingConsumer, FlowMicrobatch
from .costs import flow_costs, group_seconds
from .encoder_cost import EncoderCost
from .errors import GroupingError, SampleError, StreamError
from .grouping import FlowGrouping, group_step
from .meta import SampleKey, SampleMeta
from .plan import StepNumbering, compose_flow, compose_flow_steps
from .producer import EmbeddingProducer, ProducerStats
from .ranks import FlowRanks, FlowRole

__all__ = ["ConsumerStats", "EmbeddingConsumer", "EmbeddingProducer", "EncoderCost", "FlowGrouping", "FlowMicrobatch",
           "FlowRanks", "FlowRole", "GroupingError", "ProducerStats", "SampleError", "SampleKey", "SampleMeta",
           "StepNumbering", "StreamError", "backbone_plan", "compose_flow", "compose_flow_steps", "flow_costs",
           "group_seconds", "group_step", "stage_feed"]
