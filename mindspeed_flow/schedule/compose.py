"""compose: derive every rank's program from regions, skeletons and the seam table.

Nothing here is written per combination of skeletons.  Placement gives each microbatch its
path of visits (:mod:`.placement`, using the seam table of :mod:`.seams` for transports and
for where transposed regions run); the skeletons give each rank its compute order, merged
where layouts share a rank (:mod:`.order`); this module then wraps every compute action in
the transfers its path implies: a receive (or pool get) right before it for an input from
another rank, a send (or pool put) right after it for an output another rank needs.
Consecutive transfers form one batch, as in Megatron's ``send_forward_recv_backward``.
Trainable replicated regions also broadcast their parameters at the start of the step and
reduce their gradients at its end (each replica computes gradients for its own
microbatches only).
"""

from __future__ import annotations

from typing import Sequence

from .actions import COMPUTE, Action, Kind
from .errors import ScheduleError
from .execution import SEMANTICS, execute, explain
from .order import Duration, merge, streams, unit_duration
from .pairing import pair
from .placement import Placement, Visit
from .plan import Plan
from .regions import Region, check_cover
from .seams import POOL
from .skeletons import SHARDED

_TRANSFERS = {  # (direction, transport) -> (receive kind, send kind)
    ("act", "p2p"): (Kind.RECV_ACT, Kind.SEND_ACT),
    ("grad", "p2p"): (Kind.RECV_GRAD, Kind.SEND_GRAD),
    ("act", POOL): (Kind.POOL_GET, Kind.POOL_PUT),
    ("grad", POOL): (Kind.POOL_GET, Kind.POOL_PUT),
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
        duration: nominal compute time of an action at a visit, used only to interleave
            orders that share a rank (default: one unit per layer, backward two).
        semantics: the runtime's blocking semantics.  ``"eager"`` (sends are ``isend``)
            keeps every send right after its producer; ``"rendezvous"`` (blocking sends)
            moves sends whose receiver is not ready yet later until the programs cannot
            deadlock.
    """
    if semantics not in SEMANTICS:
        raise ScheduleError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    if num_microbatches < 1:
        raise ScheduleError(f"num_microbatches must be >= 1, got {num_microbatches}")
    check_cover(regions, num_layers)
    placement = Placement(regions)
    paths = tuple(placement.path(m) for m in range(num_microbatches))
    compute = merge(streams(placement, num_microbatches), paths, duration or unit_duration)
    programs = {rank: _with_transfers(order, paths) for rank, order in compute.items()}
    _add_collectives(programs, placement)
    if semantics == "rendezvous":
        _defer_early_sends(programs)
    return Plan(
        regions=tuple(regions),
        num_microbatches=num_microbatches,
        programs={rank: tuple(p) for rank, p in programs.items()},
        paths=paths,
        roles=placement.roles(),
        semantics=semantics,
    )


def _with_transfers(order: list[Action], paths: Sequence[Sequence[Visit]]) -> list[Action]:
    index = {(m, v.region, v.stage): k for m, path in enumerate(paths) for k, v in enumerate(path)}
    program: list[Action] = []
    for action in order:
        m = action.microbatch
        path = paths[m]
        k = index[(m, action.region, action.stage)]
        visit = path[k]
        if action.kind is Kind.FORWARD:
            before = [(visit, path[k - 1], "act", path[k - 1])] if k > 0 else []
            after = [(visit, path[k + 1], "act", visit)] if k + 1 < len(path) else []
        else:
            before = [(visit, path[k + 1], "grad", visit)] if k + 1 < len(path) else []
            upstream = k > 0 and path[k - 1].backward
            after = [(visit, path[k - 1], "grad", path[k - 1])] if upstream else []
        program += [a for t in before if (a := _transfer(0, m, *t))]
        program.append(action)
        program += [a for t in after if (a := _transfer(1, m, *t))]
    return program


def _transfer(
    side: int, m: int, own: Visit, other: Visit, direction: str, tensor: Visit
) -> Action | None:
    """A receive (side 0) or send (side 1) of ``tensor``'s output (or its gradient), or
    ``None`` when both visits share a rank."""
    # The downstream visit of the seam records how the tensor reaches it.
    downstream = own if (direction == "act") == (side == 0) else other
    if downstream.inbound in ("start", "local"):
        return None
    kind = _TRANSFERS[(direction, downstream.inbound)][side]
    return Action(kind, own.region, own.stage, m, peer=other.rank, key=f"{tensor.tag}:{direction}")


def _add_collectives(programs: dict[int, list[Action]], placement: Placement) -> None:
    for group in placement.groups:
        if group.layout == SHARDED or len(group.ranks) < 2:
            continue
        for region in group.regions:
            if not region.trainable:
                continue
            for rank in group.ranks:
                programs[rank].insert(0, Action(Kind.PARAM_BROADCAST, region.name, group=group.ranks))
                programs[rank].append(Action(Kind.GRAD_REDUCE, region.name, group=group.ranks))


def _defer_early_sends(programs: dict[int, list[Action]]) -> None:
    """Make the programs safe under rendezvous semantics.

    A send placed right after its producer may reach a receiver that posts the receive only
    much later (a transposed ViT runs ahead of the LLM stage that consumes its output);
    under blocking sends two such ranks can wait for each other.  Symbolic execution finds
    the stuck sends; each moves past the next compute of its rank, into the following
    batch, until every program runs to its end.  Sends only move later, so data flow holds.
    """
    while True:
        outcome = execute(programs, pair(programs), "rendezvous")
        if outcome.finished:
            return
        stuck = sorted(
            {op for ops in outcome.blocked.values() for op, _ in ops
             if programs[op[0]][op[1]].kind in (Kind.SEND_ACT, Kind.SEND_GRAD)},
            reverse=True,
        )
        if not stuck:
            raise ScheduleError(explain(programs, outcome, "rendezvous"))
        for rank, i in stuck:
            program = programs[rank]
            send = program.pop(i)
            j = i
            while j < len(program) and program[j].kind not in COMPUTE and program[j].group == ():
                j += 1
            program.insert(min(j + 1, len(program)), send)
