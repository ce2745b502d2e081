"""The benchmark's baselines: the Megatron-style uniform search finds the best co-located
config (checked against an exhaustive loop that composes and simulates every config,
``colocated_rates``), and the DistTrain-like split never beats the allocator's optimum."""

from __future__ import annotations

import itertools
import random

import pytest

from mindspeed_flow.allocator import InfeasibleError, Workload, solve
from mindspeed_flow.allocator.baselines import disttrain_like, megatron_uniform
from mindspeed_flow.allocator.colocated import colocated_memory, colocated_split, layer_caps, planned_live

from tests.allocator.test_solve import colocated_rates, exhaustive_split, random_instance


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


def test_memory_capped_split_is_the_fastest_fitting_one_where_the_balanced_one_does_not_fit():
    """Where the time-balanced split overflows a stage, the capped split is found and is the
    exhaustive enumeration's best fitting split; everywhere else both agree too."""
    rng = random.Random(11)
    rescued = compared = 0
    for _ in range(60):
        model, cluster, proxy, workload = random_instance(rng)
        enc, bb = model.encoder, model.backbone
        limit = cluster.memory_limit
        for tp, pp, mbs in itertools.product((1, 2), (2, 3, 4), (1, 2)):
            if pp > bb.layers or workload.global_batch % mbs:
                continue
            vit = proxy.region_cost("encoder", enc, tp, mbs, enc.layers).forward
            layer = proxy.backbone_costs(bb, tp, mbs)[0].forward / bb.layers
            balanced = colocated_split(vit, layer, bb.layers, enc.layers, pp)
            for dp in (1, 2):
                microbatches = workload.global_batch // (dp * mbs)
                caps = layer_caps(model, workload, limit, tp, dp, mbs, pp, microbatches)
                found = colocated_split(vit, layer, bb.layers, enc.layers, pp, caps)
                assert found == exhaustive_split(model, workload, limit, tp, dp, mbs, pp, vit, layer)
                compared += 1
                live = planned_live(pp, microbatches)
                if found is not None and colocated_memory(model, workload, tp, dp, mbs, balanced,
                                                          live).total > limit:
                    assert found != balanced
                    assert colocated_memory(model, workload, tp, dp, mbs, found, live).total <= limit
                    rescued += 1
    assert compared >= 500 and rescued >= 5  # the capped branch really exercised
