"""The step of a decoupled layout: the composed plan of ``<Decoupled, 1F1B>`` over one slice.

The functions take a :class:`~.layout.DecoupledLayout` (typed ``Any`` here: the layout's
methods call them, so this module does not import it back).

Encoder forwards ``PUT`` their embeddings, the first backbone stage ``GET``s each
microbatch's embeddings when it needs them (whichever replica made them) and ``PUT``s their
gradients back, which the owning replica ``GET``s for its backward; the replicas then reduce
their weight gradients among themselves only (the plan's ``REDUCE`` over the encoder
replicas).  Same samples, same gradients as synchronous training; only the timing moves.
"""

from __future__ import annotations

from typing import Any

from ..schedule import Decoupled, OneFOneB, Region, compose
from ..schedule.plan import Plan
from ..schedule.regions import BACKBONE_REGION, ENCODER_REGION


def regions(layout: Any, trainable_encoder: bool = True) -> list[Region]:
    """The slice's two regions: the encoder replicas (``Decoupled``, at most ``max_ahead``
    microbatches ahead of their backward) and the backbone pipeline (1F1B)."""
    return [Region(ENCODER_REGION, layout.encoder_layers,
                   Decoupled(ranks=layout.encoder_dp, max_in_flight=layout.max_ahead), trainable=trainable_encoder),
            Region(BACKBONE_REGION, layout.backbone_layers, OneFOneB(stages=layout.backbone_pp))]


def slice_plan(layout: Any, num_microbatches: int, trainable_encoder: bool = True) -> Plan:
    """One slice's per-rank programs over its ``num_microbatches``; plan rank ``i`` is global
    rank ``layout.executor_ranks(rank)[i]``."""
    return compose(regions(layout, trainable_encoder), num_microbatches)
