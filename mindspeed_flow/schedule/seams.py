"""Seam rules: how two adjacent regions with different skeletons talk.

A seam joins the last layer of one region (left) to the first layer of the next (right).
The layouts on either side decide everything: which rank holds a microbatch's activations
when it leaves the left region (its *exit rank*: the last stage for a sharded layout, the
owner ``m % n`` for a replicated one), which rank needs them (the right region's *entry
rank*), how they travel, and where a transposed region finds its ranks.  Gradients go back
along the same route, the other way, exactly when the left region has a backward pass
(see :func:`.regions.backward_kinds`); when exit and entry rank coincide nothing travels.

=============  =============  =========  ==================================================
left layout    right layout   transport  rule
=============  =============  =========  ==================================================
sharded        sharded        p2p        the right stages extend the left pipeline on new
                                         ranks; one order over all stages (lockstep);
                                         both sides must use the same order (1F1B, GPipe)
sharded        transposed     p2p        last stage -> owner of m; the transposed region
                                         runs on the left pipeline's ranks (if no sharded
                                         region follows it)
transposed     sharded        p2p        owner of m -> first stage; the transposed region
                                         runs on the right pipeline's ranks, in its bubbles
sharded        decoupled      pool       last stage puts m, the owner of m gets it
decoupled      sharded        pool       owner of m puts, the first stage gets m
decoupled      transposed     pool       owner puts, the transposed owner of m gets
transposed     decoupled      pool       transposed owner puts, the decoupled owner gets
decoupled      decoupled      pool       left owner puts, right owner gets
=============  =============  =========  ==================================================

A *flow* seam (:data:`FLOW`) is the pool addressed per sample instead of per microbatch:
the two sides group the step's samples differently (FlowTrain's packing after encoding), so
each encoder batch puts every sample's embeddings on its own (``PUT ... smpS``), the
backbone's first stage gets the samples of each of its microbatches by sample, and gradients
come back the same way.  No composition of skeletons produces it: the regrouping is data (a
:class:`mindspeed_flow.flow.FlowGrouping`), and :func:`mindspeed_flow.flow.compose_flow`
builds the plan, whose visits after the seam arrive ``inbound == FLOW``.

Adjacent regions with *equal* skeletons form one segment and meet at no seam: a sharded
segment cuts their layers together over its stages (a ViT inside stage 0), a replicated
segment runs them back to back on the owner.  ``transposed -> transposed`` therefore never
occurs.  :func:`seam_rule` is the only way :mod:`.compose` learns how a seam works.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ScheduleError
from .skeletons import DECOUPLED, SHARDED, TRANSPOSED

P2P = "p2p"
POOL = "pool"
FLOW = "flow"  # the pool, per sample (a flow plan)


@dataclass(frozen=True)
class SeamRule:
    """One row of the seam table.

    Attributes:
        transport: ``"p2p"`` (send/recv between ranks) or ``"pool"`` (put/get through the
            unified memory pool).
        joins_pipeline: the right sharded region continues the left one's pipeline.
        hosts_transposed: which side lends its ranks to a transposed region at this seam
            (``"left"``/``"right"``), or ``None``.
    """

    transport: str
    joins_pipeline: bool = False
    hosts_transposed: str | None = None


SEAM_TABLE: dict[tuple[str, str], SeamRule] = {
    (SHARDED, SHARDED): SeamRule(P2P, joins_pipeline=True),
    (SHARDED, TRANSPOSED): SeamRule(P2P, hosts_transposed="left"),
    (TRANSPOSED, SHARDED): SeamRule(P2P, hosts_transposed="right"),
    (SHARDED, DECOUPLED): SeamRule(POOL),
    (DECOUPLED, SHARDED): SeamRule(POOL),
    (DECOUPLED, TRANSPOSED): SeamRule(POOL),
    (TRANSPOSED, DECOUPLED): SeamRule(POOL),
    (DECOUPLED, DECOUPLED): SeamRule(POOL),
}


def seam_rule(left: str, right: str, where: str) -> SeamRule:
    """The rule for a seam between layouts ``left`` and ``right`` (``where`` names it)."""
    try:
        return SEAM_TABLE[(left, right)]
    except KeyError:
        raise ScheduleError(f"no seam rule for {left} -> {right} at {where}") from None
