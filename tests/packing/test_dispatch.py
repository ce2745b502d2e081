"""Dispatch: equal counts per rank, the snake/zig-zag rule, balance."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mindspeed_flow.packing import dispatch


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 4), st.data())
def test_dispatch_is_a_permutation_with_equal_counts(dp, per_rank, pp, data):
    costs = data.draw(st.lists(st.floats(0, 1e3), min_size=dp * per_rank, max_size=dp * per_rank))
    ranks = dispatch(costs, dp, pp_size=pp)
    assert len(ranks) == dp and all(len(r) == per_rank for r in ranks)
    assert sorted(i for r in ranks for i in r) == list(range(len(costs)))


def test_uneven_count_is_an_error():
    with pytest.raises(ValueError, match=r"10 packs cannot give 4 DP ranks"):
        dispatch([1.0] * 10, 4)
    with pytest.raises(ValueError):
        dispatch([1.0] * 4, 0)


def test_snake_deal_when_no_swap_helps():
    # Costs 8..1: snake rounds (8,7), (5,6)->reversed, (4,3), (1,2)->reversed.
    ranks = dispatch([8, 7, 6, 5, 4, 3, 2, 1], 2)
    assert ranks == [[0, 3, 4, 7], [1, 2, 5, 6]]  # loads 18 and 18


def test_zigzag_microbatch_order_with_pipeline():
    costs = [10, 1, 7, 3, 5, 2]
    (order,) = dispatch(costs, 1, pp_size=2)
    assert order == [0, 1, 2, 5, 4, 3]  # heaviest, lightest, 2nd heaviest, 2nd lightest, ...
    (order,) = dispatch(costs, 1, pp_size=1)
    assert order == [0, 2, 4, 3, 5, 1]  # heaviest first


def test_swap_repair_balances_heavy_tailed_costs():
    rng = np.random.default_rng(0)
    worst_snake, worst = 0.0, 0.0
    for _ in range(20):
        costs = 1.0 + 0.4 * np.minimum(rng.pareto(1.5, 64), 5.0)  # tail below a rank's load
        loads = [costs[r].sum() for r in dispatch(costs, 8)]
        worst = max(worst, max(loads) / np.mean(loads))
        table = np.argsort(-costs, kind="stable").reshape(8, 8)
        table[1::2] = table[1::2, ::-1]
        snake = [costs[table[:, d]].sum() for d in range(8)]
        worst_snake = max(worst_snake, max(snake) / np.mean(snake))
    assert worst < worst_snake and worst < 1.05


def test_dispatch_breaks_ties_by_pack_index():
    # Equal costs sort by index: snake rounds (0,1,2), (5,4,3), (6,7,8), (11,10,9); no swap
    # helps; zig-zag inside a rank: "heaviest" (lowest index), "lightest" (highest), ...
    assert dispatch([1.0] * 12, 3, pp_size=2) == [[0, 11, 5, 6], [1, 10, 4, 7], [2, 9, 3, 8]]
