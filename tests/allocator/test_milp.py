"""The MILP alone: lexicographic objective on instances full of ties (integer rates), and
runner-up cuts.  Brute force enumerates every (encoder, backbone) candidate pair."""

from __future__ import annotations

import random

from mindspeed_flow.allocator.milp import AllocationMilp


def lexicographic_key(production: float, consumption: float, devices: int) -> tuple[float, float, int]:
    """The objective as a sort key (smaller is better): throughput, mismatch, devices."""
    return (-min(production, consumption), abs(production - consumption), devices)


def _instance(rng: random.Random):
    ne, nb, nj = rng.randint(1, 8), rng.randint(1, 12), rng.choice([0, 0, 1, 3])
    enc = [(rng.randint(1, 6), rng.choice([1, 2, 4]), rng.randint(1, 4)) for _ in range(ne)]
    bb = [(rng.randint(1, 6), rng.choice([2, 4, 8]), rng.randint(1, 4)) for _ in range(nb)]
    joint = [(rng.randint(1, 6), rng.choice([2, 4, 8, 12]), rng.randint(1, 4)) for _ in range(nj)]
    return enc, bb, joint, rng.randint(3, 14)


def _milp(enc, bb, joint, budget):
    return AllocationMilp([e[0] for e in enc], [e[1] for e in enc], [e[2] for e in enc],
                          [b[0] for b in bb], [b[1] for b in bb], [b[2] for b in bb], budget,
                          [j[0] for j in joint], [j[1] for j in joint], [j[2] for j in joint])


def _brute(enc, bb, joint, budget, banned=()):
    keys = [lexicographic_key(e[0], b[0], e[1] + b[1]) for j, b in enumerate(bb) if j not in banned
            for e in enc if e[1] + b[1] <= budget]
    keys += [lexicographic_key(j[0], j[0], j[1]) for j in joint if j[1] <= budget]
    return min(keys) if keys else None


def _key(choice, enc, bb, joint):
    if choice.joint is not None:
        j = joint[choice.joint]
        return lexicographic_key(j[0], j[0], choice.devices)
    return lexicographic_key(enc[choice.encoder][0], bb[choice.backbone][0], choice.devices)


def test_lexicographic_optimum_with_ties_matches_brute_force():
    rng = random.Random(7)
    feasible = joints = 0
    for case in range(400):
        enc, bb, joint, budget = _instance(rng)
        expected = _brute(enc, bb, joint, budget)
        choice = _milp(enc, bb, joint, budget).solve()
        if expected is None:
            assert choice is None, f"case {case}"
            continue
        feasible += 1
        joints += choice.joint is not None
        got = _key(choice, enc, bb, joint)
        assert got == expected, f"case {case}: {got} != {expected}"
        assert (choice.throughput, choice.mismatch) == (-expected[0], expected[1])
    assert feasible > 200 and joints > 20


def test_each_stage_decides_a_tie_of_the_previous_one():
    # Same throughput 5: mismatch decides (encoder 1: |6-5| = 1 beats |9-5| = 4) although it
    # costs more devices; then devices decide between equal mismatches.
    enc = [(9, 1, 1), (6, 4, 1), (6, 2, 1)]
    bb = [(5, 4, 1)]
    choice = _milp(enc, bb, [], budget=16).solve()
    assert (choice.encoder, choice.throughput, choice.mismatch, choice.devices) == (2, 5, 1, 6)
    # A co-located candidate at the same throughput has no mismatch: it wins stage 2.
    choice = _milp(enc, bb, [(5, 12, 1)], budget=16).solve()
    assert (choice.joint, choice.throughput, choice.mismatch, choice.devices) == (0, 5, 0, 12)


def test_excluded_backbones_give_the_runner_up():
    rng = random.Random(8)
    for _ in range(50):
        enc, bb, _, budget = _instance(rng)
        milp = _milp(enc, bb, [], budget)
        first = milp.solve()
        if first is None:
            continue
        milp.exclude_backbone([first.backbone])
        second = milp.solve()
        expected = _brute(enc, bb, [], budget, banned={first.backbone})
        if expected is None:
            assert second is None
        else:
            assert second.backbone != first.backbone
            assert _key(second, enc, bb, []) == expected
