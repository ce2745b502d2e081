"""``group_step(candidates=...)``: a caller's own grouping of the step's samples (a job's loader's
packs, ``flow_repack`` in MindSpeed-MM's job) weighed with best-fit's and the cost fill's, so the
step's microbatches are never dearer than the caller's by the LLM's cost model, and a step whose
greedy fill cannot fit the job's microbatch count still gets one."""

from __future__ import annotations

import pytest

from mindspeed_flow.flow import EncoderCost, GroupingError, SampleMeta, group_step
from mindspeed_flow.packing import CostModel, pack

COST = CostModel(linear=1.0, quadratic=0.1)


def grouped(lengths: list[int], capacity: int, count: int, candidates=()):
    samples = [SampleMeta(i, 0, n) for i, n in enumerate(lengths)]
    return group_step(samples, capacity=capacity, llm_cost=COST, encoder_cost=EncoderCost(linear=1.0),
                      encoder_budget=1.0, pp=2, microbatches=count, candidates=candidates)


def test_a_step_the_fill_cannot_fit_takes_the_callers_packs():
    """Two packs of 10 tokens hold ``[5, 3, 2] [4, 2, 2, 2]``; best-fit makes three, and the
    heaviest-first fill puts 5 and 4 together and then fits no 2: without the loader's packs
    the step is refused, with them it has its 2 microbatches."""
    lengths, loader = [5, 3, 2, 4, 2, 2, 2], [[0, 1, 2], [3, 4, 5, 6]]
    assert len(pack(lengths, 10)) == 3
    with pytest.raises(GroupingError, match="fits none of 2 microbatches"):
        grouped(lengths, 10, 2)
    grouping = grouped(lengths, 10, 2, candidates=[loader])
    assert {frozenset(mb) for mb in grouping.microbatches} == {frozenset(p) for p in loader}
    grouping.check(range(len(lengths)))


def test_the_fill_wins_over_a_dearer_candidate():
    """The loader's packs ``[0, 3] [1, 2]`` put both long samples together (the dearest
    microbatch costs 16 + 12.8); the cost fill pairs each long sample with a short one."""
    grouping = grouped([8, 1, 1, 8], 20, 2, candidates=[[[0, 3], [1, 2]]])
    assert {frozenset(mb) for mb in grouping.microbatches} == {frozenset({0, 1}), frozenset({2, 3})}


@pytest.mark.parametrize("candidate, message", [
    ([[0, 1, 2, 3]], "candidate 0 has 1 microbatches, step 0 has 2"),
    ([[0, 1], [1, 2, 3]], r"sample 1 is in candidate 0's microbatches \[0, 1\] \(repeated\)"),
    ([[0, 1], [2]], r"sample 3 is in no candidate 0's microbatch \(lost\)"),
    ([[0, 3, 1], [2]], "candidate 0's microbatch 0 holds 17 LLM tokens, more than the capacity of 10"),
], ids=["count", "repeated", "lost", "capacity"])
def test_a_bad_candidate_is_refused_naming_it(candidate, message):
    with pytest.raises(GroupingError, match=message):
        grouped([8, 1, 1, 8], 10, 2, candidates=[candidate])


def test_equal_step_costs_summed_in_another_order_do_not_decide():
    """One replica: every grouping's busiest replica is the whole step's cost, the same sum
    added in another order.  Here the candidate's comes out a rounding error lower
    (1501.1369999999997 against 1501.137); its dearest microbatch (1127.9) must lose to the
    fill's (820.6) all the same."""
    cost = CostModel(linear=0.37, quadratic=1.0 / 3000)
    samples = [SampleMeta(i, 0, n) for i, n in enumerate([2, 552, 554, 639, 806])]
    grouping = group_step(samples, capacity=3000, llm_cost=cost, encoder_cost=EncoderCost(linear=1.0),
                          encoder_budget=1.0, pp=2, microbatches=2, candidates=[[[3, 0], [1, 2, 4]]])
    assert {frozenset(mb) for mb in grouping.microbatches} == {frozenset({4, 1}), frozenset({3, 2, 0})}
