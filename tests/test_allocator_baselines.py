"""The benchmark's baselines: the Megatron-style uniform search finds the best co-located
config (checked against an exhaustive loop that composes and simulates every config here),
and the DistTrain-like split never beats the allocator's optimum."""

from __future__ import annotations

import random

import pytest

from mindspeed_flow.allocator import ClusterSpec, InfeasibleError, ModelSpec, ModuleSpec, ProxyModel, Workload, solve
from mindspeed_flow.allocator.baselines import colocated_split, disttrain_like, megatron_uniform
from mindspeed_flow.allocator.memory import stage_memory
from mindspeed_flow.schedule import CostTable, OneFOneB, Region, compose, simulate

from test_allocator_solve import random_instance, synthetic_profile


def test_colocated_split_puts_the_vit_on_stage_0_and_balances_it():
    split = colocated_split(vit_forward=5.0, layer_forward=1.0, layers=20, vit_layers=8, stages=4)
    assert split[0] >= 8 and sum(split) == 28
    k = split[0] - 8
    assert max(5.0 + k, max(split[1:])) == min(
        max(5.0 + j, -(-(20 - j) // 3)) for j in range(0, 19))  # no other k is more balanced
    assert colocated_split(5.0, 1.0, 20, 8, 1) == (28,)


def _exhaustive_uniform(model: ModelSpec, cluster: ClusterSpec, proxy: ProxyModel, workload: Workload) -> float:
    enc, bb = model.encoder, model.backbone
    best = 0.0
    for tp in workload.tp_choices:
        if cluster.devices_per_node % tp or enc.heads % tp or bb.heads % tp or bb.query_groups % tp:
            continue
        for pp in workload.pp_choices:
            for mbs in workload.micro_batch_choices:
                vit = proxy.region_cost("encoder", enc, tp, mbs, enc.layers)
                layers, head = proxy.backbone_costs(bb, tp, mbs)
                split = colocated_split(vit.forward, layers.forward / bb.layers, bb.layers, enc.layers, pp)
                skeleton = OneFOneB(stages=pp, layers=split[:-1] + (split[-1] + 1,))
                for dp in range(1, cluster.devices // (tp * pp) + 1):
                    if workload.global_batch % (dp * mbs):
                        continue
                    plan = compose([Region("v", enc.layers, skeleton, trainable=enc.trainable),
                                    Region("l", bb.layers, skeleton), Region("h", 1, skeleton)],
                                   workload.global_batch // (dp * mbs))
                    result = simulate(plan, CostTable({"v": vit, "l": layers, "h": head},
                                                      link=proxy.stage_link(tp, pp)))
                    live = [result.peak_live[r] for r in sorted(result.peak_live)]
                    worst = 0.0
                    for s, count in enumerate(split):
                        own = enc.layers if s == 0 else 0
                        total = stage_memory(bb, layers=count - own, tp=tp, dp=dp, samples=mbs, live=live[s],
                                             first=s == 0, last=s == pp - 1,
                                             distributed_optimizer=workload.distributed_optimizer).total
                        if own:
                            total += stage_memory(enc, layers=own, tp=tp, dp=dp, samples=mbs,
                                                  live=live[s] if enc.trainable else 0, first=False, last=False,
                                                  distributed_optimizer=workload.distributed_optimizer).total
                        worst = max(worst, total)
                    if worst > cluster.memory_limit:
                        continue
                    stage0 = enc.params + (split[0] - enc.layers) * bb.layer_params + bb.vocab * bb.hidden
                    step = result.step_time + proxy.gradient_reduce_seconds(stage0, tp, dp)
                    best = max(best, workload.global_batch / step)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_uniform_search_finds_the_exhaustive_best(seed):
    rng = random.Random(seed)
    model, cluster, proxy, workload = random_instance(rng)
    workload = Workload(global_batch=workload.global_batch, tp_choices=(1, 2), pp_choices=(1, 2, 4),
                        micro_batch_choices=(1, 2), distributed_optimizer=workload.distributed_optimizer)
    found = megatron_uniform(model, cluster, proxy, workload)
    expected = _exhaustive_uniform(model, cluster, proxy, workload)
    if found is None:
        assert expected == 0.0
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
