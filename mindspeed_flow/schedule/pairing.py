"""Which send completes which receive, and which ranks meet in which collective.

Point-to-point transfers travel on channels ``(source, destination, key)``: one channel per
boundary tensor and direction (one tag or one communicator per seam in the runtime), first
in first out, so the k-th send on a channel meets the k-th receive on it.  Pool transfers
are addressed by ``(key, microbatch)``, or ``(key, sample)`` for a flow plan's per-sample
transfers (the put's and the get's groups differ): exactly one put and one get each, each
naming the other's rank as its peer.  A collective meets the same collective (kind, region, group) of
every member, k-th with k-th.  The validator and the simulator both read programs through
this one pairing.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .actions import COLLECTIVES, MATCHING_RECV, RECVS, Action, Kind
from .errors import ScheduleError

# An action's address: (rank, index in that rank's program).
Ref = tuple[int, int]


@dataclass(frozen=True)
class Pairing:
    """partner: each transfer's other end; members: each collective's participants."""

    partner: dict[Ref, Ref]
    members: dict[Ref, tuple[Ref, ...]]


# The action that should complete a transfer: (its rank, the transfer) -> the other end,
# or None when it cannot be told (used to name a missing end in error messages).
Counterpart = Callable[[int, Action], "Action | None"]


def pair(programs: Mapping[int, Sequence[Action]], counterpart: Counterpart | None = None) -> Pairing:
    """Pair every transfer and collective, or raise naming the first unmatched one (and,
    given ``counterpart``, the action that is missing on the other rank)."""
    partner: dict[Ref, Ref] = {}
    _pair_p2p(programs, partner, counterpart)
    _pair_pool(programs, partner)
    return Pairing(partner, _pair_collectives(programs))


def describe(programs: Mapping[int, Sequence[Action]], ref: Ref) -> str:
    """How every error message names an action: its rank, its index and its text."""
    rank, i = ref
    return f"rank {rank} action #{i} `{programs[rank][i]}`"


def _pair_p2p(
    programs: Mapping[int, Sequence[Action]],
    partner: dict[Ref, Ref],
    counterpart: Counterpart | None,
) -> None:
    sends: dict[tuple, list[Ref]] = defaultdict(list)
    recvs: dict[tuple, list[Ref]] = defaultdict(list)
    for rank, program in programs.items():
        for i, a in enumerate(program):
            if a.kind in MATCHING_RECV:
                sends[(rank, a.peer, MATCHING_RECV[a.kind], a.key)].append((rank, i))
            elif a.kind in RECVS and a.kind is not Kind.POOL_GET:
                recvs[(a.peer, rank, a.kind, a.key)].append((rank, i))
    _check_shape_keys(programs, sends, recvs)
    channels = sorted(set(sends) | set(recvs), key=repr)
    for channel in channels:  # a missing end is named before the FIFO drift it causes
        src, dst, _, _ = channel
        for ref in _spare(programs, sends[channel], recvs[channel]):
            raise ScheduleError(_unmatched(programs, ref, "receive", dst, counterpart))
        for ref in _spare(programs, recvs[channel], sends[channel]):
            raise ScheduleError(_unmatched(programs, ref, "send", src, counterpart))
    for channel in channels:
        src, dst, _, key = channel
        out, into = sends[channel], recvs[channel]
        for s, r in zip(out, into):
            ms, mr = programs[s[0]][s[1]].microbatch, programs[r[0]][r[1]].microbatch
            if ms != mr:
                raise ScheduleError(
                    f"channel r{src}->r{dst} [{key}]: shape key mismatch, "
                    f"{describe(programs, s)} sends mb{ms} but "
                    f"{describe(programs, r)} receives mb{mr} (first in, first out)"
                )
            partner[s], partner[r] = r, s


def _spare(programs: Mapping[int, Sequence[Action]], refs: list[Ref], others: list[Ref]) -> list[Ref]:
    """The ends in ``refs`` whose microbatch ``others`` (the same channel) lacks."""
    extra = Counter(programs[r][i].microbatch for r, i in refs)
    extra.subtract(programs[r][i].microbatch for r, i in others)
    found = []
    for r, i in refs:
        if extra[programs[r][i].microbatch] > 0:
            extra[programs[r][i].microbatch] -= 1
            found.append((r, i))
    return found


def _unmatched(
    programs: Mapping[int, Sequence[Action]],
    ref: Ref,
    wanted: str,
    other_rank: int,
    counterpart: Counterpart | None,
) -> str:
    missing = counterpart(ref[0], programs[ref[0]][ref[1]]) if counterpart else None
    text = f"{describe(programs, ref)} has no matching {wanted} on rank {other_rank}"
    return f"{text}: missing `{missing}`" if missing else text


def _check_shape_keys(
    programs: Mapping[int, Sequence[Action]],
    sends: Mapping[tuple, list[Ref]],
    recvs: Mapping[tuple, list[Ref]],
) -> None:
    """Name a send and a receive of one microbatch between the same two ranks that disagree
    on the shape key.  They sit on different channels, so first-in-first-out pairing alone
    would only see later messages drift apart and blame the wrong pair."""

    hops: dict[tuple, tuple[list[Ref], list[Ref]]] = defaultdict(lambda: ([], []))
    for channel in sorted(set(sends) | set(recvs), key=repr):
        src, dst, kind, _ = channel
        out, into = sends.get(channel, []), recvs.get(channel, [])
        for side, ends in ((0, _spare(programs, out, into)), (1, _spare(programs, into, out))):
            for ref in ends:
                hops[(src, dst, kind, programs[ref[0]][ref[1]].microbatch)][side].append(ref)
    for (src, dst, _, m), (out, into) in sorted(hops.items(), key=repr):
        if out and into:
            sent, wanted = programs[out[0][0]][out[0][1]].key, programs[into[0][0]][into[0][1]].key
            raise ScheduleError(
                f"r{src}->r{dst} mb{m}: shape key mismatch, {describe(programs, out[0])} "
                f"sends [{sent}] but {describe(programs, into[0])} expects [{wanted}]"
            )


def _pair_pool(programs: Mapping[int, Sequence[Action]], partner: dict[Ref, Ref]) -> None:
    ends: dict[tuple[str, str], dict[Kind, list[Ref]]] = defaultdict(lambda: defaultdict(list))
    for rank, program in programs.items():
        for i, a in enumerate(program):
            if a.kind in (Kind.POOL_PUT, Kind.POOL_GET):
                address = f"mb{a.microbatch}" if a.sample is None else f"smp{a.sample}"
                ends[(a.key, address)][a.kind].append((rank, i))
    for (key, m), by_kind in sorted(ends.items(), key=repr):
        puts, gets = by_kind[Kind.POOL_PUT], by_kind[Kind.POOL_GET]
        for ref in puts[1:] + gets[1:]:
            raise ScheduleError(f"{describe(programs, ref)}: [{key}] {m} is pooled twice")
        if not gets:
            raise ScheduleError(f"{describe(programs, puts[0])} is never taken from the pool")
        if not puts:
            raise ScheduleError(f"{describe(programs, gets[0])} waits for a put nobody makes")
        for ref, other in ((puts[0], gets[0]), (gets[0], puts[0])):
            if programs[ref[0]][ref[1]].peer != other[0]:
                raise ScheduleError(
                    f"{describe(programs, ref)}: [{key}] {m} is pooled between this rank and "
                    f"rank {other[0]} ({describe(programs, other)}), not r{programs[ref[0]][ref[1]].peer}"
                )
        partner[puts[0]], partner[gets[0]] = gets[0], puts[0]


def _pair_collectives(programs: Mapping[int, Sequence[Action]]) -> dict[Ref, tuple[Ref, ...]]:
    calls: dict[tuple, dict[int, list[Ref]]] = defaultdict(lambda: defaultdict(list))
    for rank, program in programs.items():
        for i, a in enumerate(program):
            if a.kind in COLLECTIVES:
                if rank not in a.group:
                    raise ScheduleError(f"{describe(programs, (rank, i))}: rank {rank} is not in its group")
                calls[(a.kind, a.region, a.group)][rank].append((rank, i))
    members: dict[Ref, tuple[Ref, ...]] = {}
    for (kind, region, group), by_rank in calls.items():
        counts = {r: len(by_rank.get(r, [])) for r in group}
        if len(set(counts.values())) > 1:
            raise ScheduleError(
                f"{kind.value} {region} group={list(group)}: members call it unequally often {counts}"
            )
        for k in range(counts[group[0]]):
            refs = tuple(by_rank[r][k] for r in group)
            for ref in refs:
                members[ref] = refs
    return members

