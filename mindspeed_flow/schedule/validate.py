"""validate: prove a plan's programs are complete, matched, ordered and deadlock-free.

Checks, in order, each raising :class:`.ScheduleError` naming the first fault:

1. every action is well formed and runs where the placement puts it;
2. every forward, and every backward the trainable bits require, runs exactly once;
3. every send has exactly one matching receive with the same shape key (see
   :mod:`.pairing`), every pool put one get, every collective all its members;
4. on every rank, each microbatch's input is there before a compute uses it and a tensor is
   computed before it is sent (so forward precedes backward and region order holds: with
   3, every dependency happens before its use);
   In a flow plan (:mod:`mindspeed_flow.flow.plan`: the pool addressed per sample, the two
   sides grouped differently) every sample is in one group on each side of the flow seam,
   and the same walk follows samples: a sample's embeddings are made by its encoder batch's
   forward before they are put, got before the backbone microbatch that holds it runs its
   forward; its gradient is made by that microbatch's backward before it is put back, and got
   before the encoder batch's backward;
5. every trainable replicated region broadcasts its parameters before its first forward and
   reduces its gradients after its last backward, once on each replica, over exactly its
   replica group; no other collective exists; a ``max_in_flight`` window holds (see
   :mod:`.replicas`);
6. symbolic execution under blocking semantics reaches the end of every program.

Two blocking semantics are understood.  ``"rendezvous"``: a send completes only once its
receive is posted (NCCL/HCCL p2p); consecutive transfers are posted together as one batch
(``batch_isend_irecv``, Megatron's ``send_forward_recv_backward``) and the batch completes
when each of them has met its partner.  ``"eager"``: a send completes when its message is
handed to the transport (``isend``); a receive blocks until the message was sent.  Pool puts
never block (the pool holds the tensor), gets block until the put; collectives block until
every member has reached them.  Rendezvous is the stricter; a plan that passes it passes
eager as well.  :func:`.compose` makes programs for either.
"""

from __future__ import annotations

from collections import Counter
from typing import Hashable, Sequence

from .actions import BACKWARDS, COLLECTIVES, COMPUTE, MATCHING_RECV, RECVS, SENDS, Action, Kind
from .errors import ScheduleError
from .execution import SEMANTICS, execute, explain
from .keys import BoundaryKind
from .pairing import describe, pair
from .plan import Plan
from .regions import backward_kinds
from .replicas import check_replicas
from .seams import FLOW

ACT, GRAD, INPUT, TAKEN = BoundaryKind.ACT, BoundaryKind.GRAD, BoundaryKind.INPUT, BoundaryKind.TAKEN


def validate(plan: Plan, *, semantics: str | None = None) -> None:
    """Raise :class:`.ScheduleError` for the first fault in ``plan``; return if none.

    ``semantics`` defaults to the one the plan was composed for.
    """
    semantics = semantics or plan.semantics
    if semantics not in SEMANTICS:  # fail before the slower checks
        raise ScheduleError(f"semantics must be one of {SEMANTICS}, got {semantics!r}")
    programs = plan.programs
    _check_actions(plan)
    _check_samples(plan)
    _check_complete(plan)
    pairing = pair(programs, lambda rank, action: _counterpart(plan, rank, action))
    check_replicas(plan)
    for rank, program in programs.items():
        _check_dataflow(plan, rank, program)
    outcome = execute(programs, pairing, semantics)
    if not outcome.finished:
        raise ScheduleError(explain(programs, outcome, semantics))


def _check_actions(plan: Plan) -> None:
    ranks = set(plan.programs)
    for rank, program in plan.programs.items():
        for i, a in enumerate(program):
            where = describe(plan.programs, (rank, i))
            if a.kind in COLLECTIVES:
                continue
            if a.microbatch is None or not 0 <= a.microbatch < plan.num_microbatches:
                last = plan.num_microbatches - 1
                raise ScheduleError(f"{where}: microbatch {a.microbatch} is not in 0..{last}")
            found = plan.visits.get((a.microbatch, a.region, a.stage))
            if found is None:
                raise ScheduleError(f"{where}: region {a.region!r} has no stage {a.stage}")
            # a recomputed backward (and the input it receives) runs where the visit says
            remote = a.kind in BACKWARDS or a.kind in RECVS and a.carries is INPUT
            placed = found[1].backward_on if remote else found[1].rank
            if placed != rank:
                raise ScheduleError(
                    f"{where}: {a.region}.s{a.stage} mb{a.microbatch} is placed on rank "
                    f"{placed}, not {rank}"
                )
            if a.kind not in COMPUTE and (a.peer not in ranks or a.peer == rank):
                raise ScheduleError(f"{where}: peer {a.peer} is not another rank")


def _flow_side(plan: Plan, microbatch: int) -> str | None:
    """Which side of a flow seam a group is on: ``"consumer"`` when its path starts after
    the seam, ``"producer"`` when it ends before the model's last region; else ``None``."""
    path = plan.paths[microbatch]
    if path[0].inbound == FLOW:
        return "consumer"
    return "producer" if plan.samples and path[-1].region != plan.regions[-1].name else None


def _check_samples(plan: Plan) -> None:
    """Every sample of a flow plan is in exactly one producer group and one consumer group."""
    where: dict[str, dict[int, int]] = {"producer": {}, "consumer": {}}
    for m, ids in sorted(plan.samples.items()):
        if not 0 <= m < len(plan.paths):
            raise ScheduleError(f"the plan lists samples of mb{m}, which is not in 0..{len(plan.paths) - 1}")
        side = _flow_side(plan, m)
        if side is None:
            raise ScheduleError(f"mb{m} lists samples {list(ids)} but its path meets no flow seam")
        for s in ids:
            if s in where[side]:
                raise ScheduleError(f"smp{s} is in {side} groups mb{where[side][s]} and mb{m}: a sample is "
                                    "grouped once on each side")
            where[side][s] = m
    for side, other in (("producer", "consumer"), ("consumer", "producer")):
        for s, m in where[side].items():
            if s not in where[other]:
                raise ScheduleError(f"smp{s} of {side} group mb{m} is in no {other} group")


def _check_complete(plan: Plan) -> None:
    seen = Counter(
        (a.kind, a.microbatch, a.region, a.stage)
        for program in plan.programs.values()
        for a in program
        if a.kind in COMPUTE
    )
    for m, path in enumerate(plan.paths):
        for v in path:
            expected = [Kind.FORWARD] + [Kind(letter) for letter in v.backward or ""]
            for kind in expected:
                count = seen.pop((kind, m, v.region, v.stage), 0)
                if count != 1:
                    raise ScheduleError(
                        f"{kind.value} {v.tag} mb{m} runs {count} times on rank {v.rank}, expected once"
                    )
    for (kind, m, region, stage) in seen:
        reason = "a frozen region without a gradient path" if kind in BACKWARDS else "not on the path"
        raise ScheduleError(f"unexpected {kind.value} {region}.s{stage} mb{m}: {reason}")


# What a rank holds besides received tensors: a visit's forward (kept for its backward) and
# its input gradients (kept for the weight gradients of a split backward).
_FORWARD, _INPUT_GRADS = "forward", "input-gradient backward"


def _check_dataflow(plan: Plan, rank: int, program: Sequence[Action]) -> None:
    """Walk one program keeping the tensors it holds: inputs must be there before use."""
    held: set[tuple[Hashable, int]] = set()  # (boundary key or (visit, _FORWARD | _INPUT_GRADS), microbatch)
    pooled: set[tuple[BoundaryKind, int]] = set()  # a flow plan's (act | grad, sample) on this rank
    for i, a in enumerate(program):
        if a.kind in COLLECTIVES:
            continue
        m = a.microbatch
        k, visit = plan.visits[(m, a.region, a.stage)]
        path = plan.paths[m]
        if plan.samples:
            if _check_sample_flow(plan, rank, i, a, pooled):
                continue
        needs: list[Hashable] = []
        makes: list[Hashable] = []
        if a.kind is Kind.FORWARD:
            needs = [path[k - 1].key(ACT)] if k > 0 else []
            makes = [visit.key(ACT), (visit.tag, _FORWARD)]
        elif a.kind is Kind.BACKWARD_WEIGHT:
            needs = [(visit.tag, _INPUT_GRADS)]
        elif a.kind in BACKWARDS:
            # away from its forward the backward recomputes it from the shipped input
            kept = (visit.tag, _FORWARD) if rank == visit.rank else visit.key(INPUT)
            needs = [kept] + ([visit.key(GRAD)] if k + 1 < len(path) else [])
            makes = ([path[k - 1].key(GRAD)] if k > 0 else []) + [(visit.tag, _INPUT_GRADS)]
        elif a.kind in SENDS:
            needs = [] if a.carries is INPUT else [a.key]  # the model's input is data
        elif a.kind in RECVS:
            makes = [a.key]
        for need in needs:
            if (need, m) not in held:
                what = need[1] if isinstance(need, tuple) else f"[{need}]"
                raise ScheduleError(
                    f"{describe(plan.programs, (rank, i))}: needs {what} of mb{m} "
                    "earlier on this rank (microbatch order broken)"
                )
        held.update((make, m) for make in makes)


def _check_sample_flow(plan: Plan, rank: int, i: int, a: Action, pooled: set[tuple[BoundaryKind, int]]) -> bool:
    """One action of a flow plan against the samples this rank holds; returns whether it
    was a per-sample transfer (nothing else to check).  A group's forward makes (producer)
    or needs (consumer) every sample's embeddings, its backward needs (producer) or makes
    (consumer, when gradients flow further back) every sample's gradient; a put needs what
    it sends, a get makes what it takes."""
    where = describe(plan.programs, (rank, i))
    group = plan.samples.get(a.microbatch, ())
    if a.sample is not None:
        if a.kind not in (Kind.POOL_PUT, Kind.POOL_GET):
            raise ScheduleError(f"{where}: only a pool put or get carries a sample")
        if a.sample not in group:
            raise ScheduleError(f"{where}: smp{a.sample} is not one of mb{a.microbatch}'s samples {list(group)}")
        if a.carries not in (ACT, GRAD, TAKEN):
            raise ScheduleError(f"{where}: a sample's pool transfer carries act, grad or taken, not {a.carries}")
        if a.kind is Kind.POOL_GET:
            pooled.add((a.carries, a.sample))
        elif a.carries is TAKEN:  # the consumer says it took the sample's entry: only after its get
            if (ACT, a.sample) not in pooled:
                raise ScheduleError(f"{where}: says smp{a.sample} was taken before its pool get")
        elif (a.carries, a.sample) not in pooled:
            made_by = "its group's forward" if _flow_side(plan, a.microbatch) == "producer" else "its backward"
            raise ScheduleError(f"{where}: puts {a.carries.value} of smp{a.sample} before {made_by} made it")
        return True
    side = _flow_side(plan, a.microbatch)
    if side is None or a.kind not in COMPUTE or a.kind is Kind.BACKWARD_WEIGHT:
        return False
    visit = plan.visits[(a.microbatch, a.region, a.stage)][1]
    path = plan.paths[a.microbatch]
    forward = a.kind is Kind.FORWARD
    if side == "producer" and visit is path[-1]:
        needs, makes = (None, ACT) if forward else (GRAD, None)
    elif side == "consumer" and visit is path[0]:
        before = [r.name for r in plan.regions].index(a.region) - 1
        upstream_backward = before >= 0 and backward_kinds(plan.regions)[plan.regions[before].name]
        needs, makes = (ACT, None) if forward else (None, GRAD if upstream_backward else None)
    else:
        return False
    for s in group:
        if needs is not None and (needs, s) not in pooled:
            raise ScheduleError(f"{where}: needs {needs.value} of smp{s} earlier on this rank "
                                "(its pool get is missing or comes later)")
        if makes is not None:
            pooled.add((makes, s))
    return False


def _counterpart(plan: Plan, rank: int, action: Action) -> Action | None:
    """The other end a point-to-point transfer needs, from the microbatch's path: an
    activation leaves the visit its key names for the next one, a gradient comes back."""
    sent_as = {recv: send for send, recv in MATCHING_RECV.items()}
    direction = action.carries
    path = plan.paths[action.microbatch] if 0 <= (action.microbatch or 0) < len(plan.paths) else ()
    k = next((k for k, v in enumerate(path) if direction and v.tag == action.key.tag), None)
    if k is None or k + 1 >= len(path) or direction not in (ACT, GRAD):
        return None
    upstream, downstream = path[k], path[k + 1]
    sender, receiver = (upstream, downstream) if direction is ACT else (downstream, upstream)
    if action.kind in MATCHING_RECV:
        kind, other = MATCHING_RECV[action.kind], receiver
    else:
        kind, other = sent_as[action.kind], sender
    return Action(kind, other.region, other.stage, action.microbatch, peer=rank, key=action.key)
