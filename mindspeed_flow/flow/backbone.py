"""The backbone's side of a flow step on the runtime: each data-parallel replica runs its
own microbatches of the :class:`~.grouping.FlowGrouping` as a plain 1F1B pipeline through the
:class:`~mindspeed_flow.runtime.Executor`, and its first stage's data iterator pulls each
microbatch's embeddings from the pool (:class:`~.consumer.EmbeddingConsumer`) right before
the microbatch's forward.

The executor never sees the pool here: the per-sample transfers happen in the first stage's
data iterator (the gets) and in an autograd hook on the embeddings (the gradient puts), so
the lowering's ``(key, microbatch)`` pool messages are not needed and the backbone's program
is exactly the one a co-located pipeline runs.  ``forward_step_func`` reads a
:class:`~.consumer.FlowMicrobatch` from its iterator: its samples, and on the first stage the
embeddings to hand to the model (``set_input_tensor``).
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache

from ..schedule import OneFOneB, Plan, Region, compose
from ..schedule.regions import BACKBONE_REGION
from .consumer import EmbeddingConsumer, FlowMicrobatch
from .errors import GroupingError
from .grouping import FlowGrouping


def backbone_plan(grouping: FlowGrouping, semantics: str = "eager") -> Plan:
    """One backbone replica's 1F1B plan for ``grouping`` (plan rank ``s`` = stage ``s``;
    the replicas all train the same number of microbatches)."""
    counts = {len(grouping.replica_microbatches(d)) for d in range(grouping.dp)}
    if len(counts) != 1:
        raise GroupingError(f"step {grouping.step}: the backbone replicas train different microbatch counts "
                            f"{sorted(counts)}; a flow step needs the same count on each")
    return _pipeline(grouping.pp, counts.pop(), semantics)


@lru_cache(maxsize=64)
def _pipeline(stages: int, microbatches: int, semantics: str) -> Plan:
    return compose([Region(BACKBONE_REGION, stages, OneFOneB(stages=stages))], microbatches, semantics=semantics)


def stage_feed(grouping: FlowGrouping, replica: int,
               consumer: EmbeddingConsumer | None = None) -> Iterator[FlowMicrobatch]:
    """Backbone replica ``replica``'s microbatches of ``grouping`` in its pipeline order: a
    stage's data iterator.  On the first stage (``consumer`` given) each carries its
    embeddings, taken from the pool when the iterator reaches it."""
    for m in grouping.replica_microbatches(replica):
        embeddings = consumer.take(grouping, m) if consumer is not None else None
        yield FlowMicrobatch(grouping.step, m, grouping.microbatches[m], embeddings)
