"""compose: derive every rank's program from regions, skeletons and the seam table.

Nothing here is written per combination of skeletons.  Placement gives each microbatch its
path of visits (:mod:`.placement`, using the seam table of :mod:`.seams` for transports and
for where transposed regions run); the skeletons give each rank its compute order, merged
where layouts share a rank by a nominal list schedule (:mod:`.order`).  Every edge of a path
that crosses ranks becomes a transfer: a send (or pool put) on the producer's rank and a
receive (or pool get) on the consumer's, for the activation forward and, when the upstream
visit has a backward pass, the gradient back.  Consecutive transfers form one batch, as in
Megatron's ``send_forward_recv_backward``.  Trainable replicated regions also broadcast
their parameters at the start of the step and reduce their gradients at its end (each
replica computes gradients for its own microbatches only).

Transfers go *just in time*: the send right after its producer, the receive right before
its consumer, so a rank waits for data only when it needs it.  That is always safe when
sends do not block (``eager``, ``isend``), and it is Megatron's own pattern, safe for plain
pipelines even when they do.  For blocking sends (``rendezvous``) symbolic execution checks
it; if it could deadlock (a transposed ViT running ahead of the LLM that consumes it), the
transfers are placed in *one global order* instead: both ends at the nominal moment the
producer finishes, in the slot between computes each rank is in at that moment.  Every rank
then meets its transfers in the same global order and the smallest unfinished transfer can
always complete (everything before it on both ranks has), so the programs cannot deadlock,
whatever the composition.
"""

from __future__ import annotations

import gc
from bisect import bisect_left
from collections import defaultdict
from contextlib import contextmanager
from operator import itemgetter
from typing import Iterator, NamedTuple, Sequence

from .actions import Action, Kind
from .errors import ScheduleError
from .execution import SEMANTICS, execute
from .keys import BoundaryKind
from .order import Duration, Timed, merge, streams, unit_duration
from .pairing import pair
from .placement import Placement, Visit
from .plan import Plan
from .regions import Region, check_cover
from .seams import POOL
from .skeletons import AHEAD, PHASED, SHARDED

_TRANSPORTS = ("p2p", POOL)
_KINDS = {  # (an activation?, transport) -> (send kind, receive kind)
    (True, "p2p"): (Kind.SEND_ACT, Kind.RECV_ACT),
    (False, "p2p"): (Kind.SEND_GRAD, Kind.RECV_GRAD),
    (True, POOL): (Kind.POOL_PUT, Kind.POOL_GET),
    (False, POOL): (Kind.POOL_PUT, Kind.POOL_GET),
}


def compose(
    regions: Sequence[Region],
    num_microbatches: int,
    *,
    num_layers: int | None = None,
    duration: Duration | None = None,
    semantics: str = "eager",
) -> Plan:
    """Derive the per-rank programs of one training step.

    Args:
        regions: the model cut into regions, in layer order.
        num_microbatches: microbatches per step.
        num_layers: the model's layer count; the regions must cover it exactly.
        duration: nominal compute time of an action at a visit, used to interleave orders
            that share a rank and to time rendezvous transfers (default: one unit per
            layer, backward two).
        semantics: the runtime's blocking semantics, ``"eager"`` or ``"rendezvous"``.
    """
    if num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be >= 1, got {num_microbatches}")
    if semantics not in SEMANTICS:
        raise ScheduleError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    check_cover(regions, num_layers)
    placement = Placement(regions)
    with _cyclic_gc_paused():
        paths = tuple(placement.path(m) for m in range(num_microbatches))
        timeline = merge(streams(placement, num_microbatches), paths, duration or unit_duration)
        transfers = _transfers(timeline, paths)
        programs = _assemble(timeline, transfers, in_one_order=False, placement=placement)
    if semantics == "rendezvous" and not execute(programs, pair(programs), semantics).finished:
        programs = _assemble(timeline, transfers, in_one_order=True, placement=placement)
    return Plan(
        regions=tuple(regions),
        num_microbatches=num_microbatches,
        programs={rank: tuple(p) for rank, p in programs.items()},
        paths=paths,
        roles=placement.roles(),
        semantics=semantics,
    )


@contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """Pause Python's cycle collector while compose builds its million small objects.

    Actions, visits and timings are acyclic (reference counting frees them), but every few
    hundred allocations the collector would walk the young ones and, as they pile up, all
    of them again: a third of compose's time at 64 stages x 512 microbatches.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class _Transfer(NamedTuple):
    """One tensor crossing ranks: produced by ``producer``, consumed by ``consumer``, which
    are computes number ``after - 1`` and ``before`` of their ranks' timelines."""

    send: Action
    recv: Action
    sender: int
    receiver: int
    producer: Timed
    consumer: Timed
    after: int
    before: int


def _transfers(timeline: dict[int, list[Timed]], paths: Sequence[Sequence[Visit]]) -> list[_Transfer]:
    """Every cross-rank edge of every path, found from its consumer."""
    # a weight-gradient step (W) neither needs nor makes a tensor of another rank
    weight = Kind.BACKWARD_WEIGHT
    # every path visits the same (region, stage) sequence; only the ranks differ
    position = {(v.region, v.stage): k for k, v in enumerate(paths[0])} if paths else {}
    keys = [(v.key(BoundaryKind.ACT), v.key(BoundaryKind.GRAD)) for v in paths[0]] if paths else []
    # (forward, microbatch, k) -> (rank, index in its timeline, compute)
    where: dict[tuple[bool, int, int], tuple[int, int, Timed]] = {}
    for rank, timed in timeline.items():
        for i, t in enumerate(timed):
            a = t.action
            if a.kind is not weight:
                where[(a.kind is Kind.FORWARD, a.microbatch, position[(a.region, a.stage)])] = (rank, i, t)
    found = []
    for rank in sorted(timeline):
        for before, consumer in enumerate(timeline[rank]):
            a, m = consumer.action, consumer.action.microbatch
            if a.kind is weight:
                continue
            path = paths[m]
            k = position[(a.region, a.stage)]
            forward = a.kind is Kind.FORWARD
            if forward and k > 0:
                up, downstream, source, key = path[k - 1], path[k], k - 1, keys[k - 1][0]
            elif not forward and k + 1 < len(path):
                up, downstream, source, key = path[k + 1], path[k + 1], k + 1, keys[k][1]
            else:
                continue
            transport = downstream.inbound
            if transport not in _TRANSPORTS:
                continue  # same rank: the tensor stays where it is
            sender, made, producer = where[(forward, m, source)]
            if sender == rank:
                continue  # a gradient made where a recomputed backward runs
            send_kind, recv_kind = _KINDS[(forward, transport)]
            found.append(_Transfer(
                Action(send_kind, up.region, up.stage, m, peer=rank, key=key),
                Action(recv_kind, a.region, a.stage, m, peer=sender, key=key),
                sender, rank, producer, consumer, made + 1, before,
            ))
    for m, path in enumerate(paths):  # a recomputed backward needs the region's input
        first = path[0]
        if first.backward_rank is not None:
            key = first.key(BoundaryKind.INPUT)
            found.append(_Transfer(
                send=Action(Kind.SEND_ACT, first.region, first.stage, m, peer=first.backward_rank, key=key),
                recv=Action(Kind.RECV_ACT, first.region, first.stage, m, peer=first.rank, key=key),
                sender=first.rank,
                receiver=first.backward_rank,
                producer=where[(True, m, 0)][2],
                consumer=where[(False, m, 0)][2],
                after=where[(True, m, 0)][1] + 1,
                before=where[(False, m, 0)][1],
            ))
    return found


def _assemble(
    timeline: dict[int, list[Timed]],
    transfers: list[_Transfer],
    in_one_order: bool,
    placement: Placement,
) -> dict[int, list[Action]]:
    """Place every transfer's two ends between the computes of their ranks: just in time,
    or all transfers in one global order; then add the collectives.

    Just in time, a transposed region with ``order="prefix"`` hands its forwards on as the
    public Mpipe code does: in one block after every rank's prefix of forwards (outputs,
    then inputs for a recomputed backward, each by microbatch), and the feature gradients of
    an owner backward in one block after the first stage's last compute (``order="phased"``:
    after its last compute of the pipeline, before the region's backward phase)."""
    # rank -> slot (the number of computes before it) -> (sort key, action)
    slots: dict[int, dict[int, list]] = {rank: defaultdict(list) for rank in timeline}
    orders = {r.name: getattr(g.skeleton, "order", None) for g in placement.groups for r in g.regions}
    prefixed = {name for name, order in orders.items() if order in AHEAD}
    prefix = {rank: next((i for i, t in enumerate(timed) if t.action.kind is not Kind.FORWARD
                          or t.action.region not in prefixed), len(timed))
              for rank, timed in timeline.items()}
    if in_one_order:
        moments = {rank: [(t.start, t.pick) for t in timed] for rank, timed in timeline.items()}
    for seq, tr in enumerate(transfers):
        if not in_one_order and tr.send.kind is Kind.SEND_ACT and tr.send.region in prefixed:
            send_slot, recv_slot = prefix[tr.sender], prefix[tr.receiver]
            send_order = recv_order = (-1, tr.send.key.kind is BoundaryKind.INPUT, tr.send.microbatch)
        elif not in_one_order and tr.recv.kind is Kind.RECV_GRAD and tr.recv.region in prefixed:
            send_slot = (_pipeline_end(timeline[tr.sender], tr.recv.region)
                         if orders[tr.recv.region] == PHASED else len(timeline[tr.sender]))
            recv_slot = tr.before
            send_order, recv_order = (2, tr.send.microbatch), (1, seq)
        elif not in_one_order:
            send_slot, recv_slot = tr.after, tr.before
            send_order, recv_order = (0, seq), (1, seq)
        else:
            moment = (tr.producer.end, tr.producer.pick + 0.5)
            send_slot = bisect_left(moments[tr.sender], moment)
            recv_slot = bisect_left(moments[tr.receiver], moment)
            send_order = recv_order = (moment, seq)
        slots[tr.sender][send_slot].append((send_order, tr.send))
        slots[tr.receiver][recv_slot].append((recv_order, tr.recv))
    programs = {}
    for rank, timed in timeline.items():
        program: list[Action] = []
        placed = slots[rank]
        for i in range(len(timed) + 1):
            if i in placed:
                slot = placed[i]
                program += [slot[0][1]] if len(slot) == 1 else [a for _, a in sorted(slot, key=itemgetter(0))]
            if i < len(timed):
                program.append(timed[i].action)
        programs[rank] = program
    _add_collectives(programs, placement)
    return programs


def _pipeline_end(timed: list[Timed], region: str) -> int:
    """The slot after a rank's last compute that is not of ``region`` (a phased transposed
    region's backwards follow it)."""
    return next((i + 1 for i in range(len(timed) - 1, -1, -1) if timed[i].action.region != region), 0)


def _add_collectives(programs: dict[int, list[Action]], placement: Placement) -> None:
    """Replicas of a trainable region start from the same parameters and end with the sum of
    their gradients: a broadcast first and a reduce last on every member, in one order."""
    for group in placement.groups:
        if group.layout == SHARDED or len(group.ranks) < 2:
            continue
        trainable = [region.name for region in group.regions if region.trainable]
        # a recomputed backward runs on one rank: its gradients need no reduce
        reduced = [] if group.recomputes else trainable
        for rank in group.ranks:
            programs[rank][:0] = [Action(Kind.PARAM_BROADCAST, n, group=group.ranks) for n in trainable]
            programs[rank] += [Action(Kind.GRAD_REDUCE, n, group=group.ranks) for n in reduced]
