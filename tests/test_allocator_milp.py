"""The MILP alone: lexicographic objective on instances full of ties (integer rates), and
runner-up cuts.  Brute force enumerates every (encoder, backbone) candidate pair."""

from __future__ import annotations

import itertools
import random

from mindspeed_flow.allocator.milp import AllocationMilp, lexicographic_key


def _instance(rng: random.Random):
    ne, nb = rng.randint(1, 8), rng.randint(1, 12)
    enc = [(rng.randint(1, 6), rng.choice([1, 2, 4]), rng.randint(1, 4)) for _ in range(ne)]
    bb = [(rng.randint(1, 6), rng.choice([2, 4, 8]), rng.randint(1, 4)) for _ in range(nb)]
    return enc, bb, rng.randint(3, 14)


def _milp(enc, bb, budget):
    return AllocationMilp([e[0] for e in enc], [e[1] for e in enc], [e[2] for e in enc],
                          [b[0] for b in bb], [b[1] for b in bb], [b[2] for b in bb], budget)


def _brute(enc, bb, budget, banned=()):
    keys = [lexicographic_key(e[0], b[0], e[1] + b[1]) for j, b in enumerate(bb) if j not in banned
            for e in enc if e[1] + b[1] <= budget]
    return min(keys) if keys else None


def test_lexicographic_optimum_with_ties_matches_brute_force():
    rng = random.Random(7)
    feasible = 0
    for case in range(400):
        enc, bb, budget = _instance(rng)
        expected = _brute(enc, bb, budget)
        choice = _milp(enc, bb, budget).solve()
        if expected is None:
            assert choice is None, f"case {case}"
            continue
        feasible += 1
        got = lexicographic_key(enc[choice.encoder][0], bb[choice.backbone][0], choice.devices)
        assert got == expected, f"case {case}: {got} != {expected}"
        assert (choice.throughput, choice.mismatch) == (-expected[0], expected[1])
    assert feasible > 200


def test_each_stage_decides_a_tie_of_the_previous_one():
    # Same throughput 5: mismatch decides (encoder 1: |6-5| = 1 beats |9-5| = 4) although it
    # costs more devices; then devices decide between equal mismatches.
    enc = [(9, 1, 1), (6, 4, 1), (6, 2, 1)]
    bb = [(5, 4, 1)]
    choice = _milp(enc, bb, budget=16).solve()
    assert (choice.encoder, choice.throughput, choice.mismatch, choice.devices) == (2, 5, 1, 6)


def test_excluded_backbones_give_the_runner_up():
    rng = random.Random(8)
    for _ in range(50):
        enc, bb, budget = _instance(rng)
        milp = _milp(enc, bb, budget)
        first = milp.solve()
        if first is None:
            continue
        milp.exclude_backbone([first.backbone])
        second = milp.solve()
        expected = _brute(enc, bb, budget, banned={first.backbone})
        if expected is None:
            assert second is None
        else:
            assert second.backbone != first.backbone
            assert lexicographic_key(enc[second.encoder][0], bb[second.backbone][0], second.devices) == expected
