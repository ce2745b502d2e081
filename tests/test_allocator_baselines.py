"""The benchmark's baselines: the Megatron-style uniform search finds the best co-located
config (checked against an exhaustive loop that composes and simulates every config,
``colocated_rates``), and the DistTrain-like split never beats the allocator's optimum."""

from __future__ import annotations

import random

import pytest

from mindspeed_flow.allocator import InfeasibleError, Workload, solve
from mindspeed_flow.allocator.baselines import disttrain_like, megatron_uniform
from mindspeed_flow.allocator.colocated import colocated_split

from test_allocator_solve import colocated_rates, random_instance


def test_colocated_split_puts_the_vit_on_stage_0_and_balances_it():
    split = colocated_split(vit_forward=5.0, layer_forward=1.0, layers=20, vit_layers=8, stages=4)
    assert split[0] >= 8 and sum(split) == 28
    assert len(set(split[1:-1])) == 1 and split[-1] <= split[1]  # Megatron's first/last flags can say it
    k = split[0] - 8
    assert max(5.0 + k, max(split[1:])) == min(
        max(5.0 + j, -(-(20 - j) // 3)) for j in range(0, 19))  # no other k is more balanced
    assert colocated_split(5.0, 1.0, 20, 8, 1) == (28,)


@pytest.mark.parametrize("seed", range(6))
def test_uniform_search_finds_the_exhaustive_best(seed):
    rng = random.Random(seed)
    model, cluster, proxy, workload = random_instance(rng)
    workload = Workload(global_batch=workload.global_batch, tp_choices=(1, 2), pp_choices=(1, 2, 4),
                        micro_batch_choices=(1, 2), distributed_optimizer=workload.distributed_optimizer)
    found = megatron_uniform(model, cluster, proxy, workload)
    expected = max((rate for rate, _ in colocated_rates(model, cluster, proxy, workload)), default=None)
    if found is None:
        assert expected is None
    else:
        assert found.throughput == pytest.approx(expected, rel=1e-9)


def test_disttrain_like_never_beats_the_plan():
    rng = random.Random(3)
    compared = 0
    for _ in range(40):
        model, cluster, proxy, workload = random_instance(rng)
        try:
            plan = solve(model, cluster, proxy, workload)
        except InfeasibleError:
            continue
        heuristic = disttrain_like(model, cluster, proxy, workload)
        if heuristic is not None:
            assert heuristic.throughput <= plan.throughput * (1 + 1e-7)
            assert heuristic.devices <= cluster.devices
            compared += 1
    assert compared >= 15
