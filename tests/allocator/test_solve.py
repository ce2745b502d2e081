"""solve() against brute force, infeasibility diagnosis and memory pruning.

Brute force here enumerates every (encoder tp, dp) x (backbone tp, pp, micro batch, dp)
itself, checks every constraint itself, asks the same proxy for rates and memory and
orders by the same lexicographic objective; it shares no code with the candidate
generation or the MILP.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from mindspeed_flow.allocator import (ClusterSpec, InfeasibleError, ModelSpec, ModuleSpec, Profile,
                                      ProfilePoint, ProxyModel, Workload, solve)
from mindspeed_flow.allocator.colocated import planned_live
from mindspeed_flow.allocator.memory import stage_memory
from mindspeed_flow.allocator.specs import GIB
from mindspeed_flow.schedule import CostTable, OneFOneB, Region, compose, simulate


def synthetic_profile(rng: random.Random) -> Profile:
    """Efficiency rising with work per rank, differently per module (inputs, not results)."""
    points = []
    for module in ("encoder", "backbone"):
        for flops in (1e8, 1e10, 1e12):
            eff = min(0.9, rng.uniform(0.1, 0.4) * (1 + math.log10(flops / 1e8) * rng.uniform(0.1, 0.5)))
            forward = flops / (eff * 1e12)
            points.append(ProfilePoint(module, 1, 1, 64, 1, forward, rng.uniform(1.8, 2.4) * forward, flops))
    return Profile("synthetic", 1.0, points)


def random_instance(rng: random.Random):
    heads = rng.choice([4, 8, 16])
    enc = ModuleSpec(layers=rng.choice([4, 8, 12]), hidden=heads * 64, heads=heads, ffn=heads * 256,
                     tokens_per_sample=rng.choice([256, 1024]), trainable=rng.random() < 0.7)
    bb_heads = rng.choice([8, 16, 32])
    bb = ModuleSpec(layers=rng.choice([6, 8, 12, 16]), hidden=bb_heads * 128, heads=bb_heads,
                    ffn=bb_heads * 512, query_groups=rng.choice([2, 4, 8]),
                    tokens_per_sample=rng.choice([1024, 2048, 4096]), vocab=rng.choice([0, 32000]))
    cluster = ClusterSpec(devices=rng.choice([4, 6, 8, 12, 16, 24, 32]), devices_per_node=rng.choice([2, 4, 8]),
                          memory_gib=rng.choice([8, 16, 32, 80]), peak_tflops=rng.choice([100, 300]),
                          intra_node_gbps=rng.choice([50, 200]), inter_node_gbps=rng.choice([10, 25]))
    placements = ("decoupled", "colocated") if rng.random() < 0.2 else ("decoupled",)
    workload = Workload(global_batch=rng.choice([6, 8, 12, 16, 24, 32]), tp_choices=(1, 2, 4),
                        pp_choices=tuple(rng.sample([1, 2, 3, 4], 3)), micro_batch_choices=(1, 2),
                        encoder_micro_batch=rng.choice([1, 2]), encoder_in_flight=rng.choice([1, 4]),
                        distributed_optimizer=rng.random() < 0.5, alternatives=0, placements=placements)
    return ModelSpec(enc, bb), cluster, ProxyModel(synthetic_profile(rng), cluster), workload


def exhaustive_split(model: ModelSpec, workload: Workload, limit: float, tp: int, dp: int, mbs: int, pp: int,
                     vit_forward: float, layer_forward: float) -> tuple[int, ...] | None:
    """Every split ``[ViT + k, per, ..., per, last]`` (each LLM stage >= 1 layer) enumerated,
    each stage's memory estimated here with the microbatches in flight (``planned_live``);
    of those that fit, the fastest slowest stage (forward), ties to smaller ``k``, then to
    the more even rest, then the larger ``per``."""
    enc, bb = model.encoder, model.backbone
    microbatches = workload.global_batch // (dp * mbs)
    opt = workload.distributed_optimizer
    best = None
    for k in range(0, bb.layers + 1 if pp == 1 else bb.layers - pp + 2):
        rest = bb.layers - k
        pers = [0] if pp <= 2 else range(1, rest)
        for per in pers:
            llm = (k,) + (per,) * (pp - 2) + (rest - per * (pp - 2),) if pp > 1 else (k,)
            if pp == 1 and k != bb.layers or pp > 1 and llm[-1] < 1:
                continue
            fits = True
            for s, (count, live) in enumerate(zip(llm, planned_live(pp, microbatches))):
                total = stage_memory(bb, layers=count, tp=tp, dp=dp, samples=mbs, live=live, first=s == 0,
                                     last=s == pp - 1, distributed_optimizer=opt).total
                if s == 0:
                    total += stage_memory(enc, layers=enc.layers, tp=tp, dp=dp, samples=mbs,
                                          live=live if enc.trainable else 0, first=False, last=False,
                                          distributed_optimizer=opt).total
                fits = fits and total <= limit
            if fits:
                heaviest = max(llm[1:], default=0)
                key = (max(vit_forward + k * layer_forward, heaviest * layer_forward), k, heaviest, -per)
                best = min(best, (key, llm), key=lambda b: b[0]) if best else (key, llm)
    return None if best is None else (enc.layers + best[1][0],) + best[1][1:]


def colocated_rates(model: ModelSpec, cluster: ClusterSpec, proxy: ProxyModel,
                    workload: Workload) -> list[tuple[float, int]]:
    """(rate, devices) of every co-located config that fits, each composed and simulated
    here: the ViT and the LLM layers and head cut by one 1F1B skeleton, ViT in stage 0."""
    enc, bb = model.encoder, model.backbone
    out = []
    for tp in workload.tp_choices:
        if cluster.devices_per_node % tp or any(m.heads % tp or m.query_groups % tp for m in (enc, bb)):
            continue
        for pp in workload.pp_choices:
            if pp > bb.layers:
                continue
            for mbs in workload.micro_batch_choices:
                vit = proxy.region_cost("encoder", enc, tp, mbs, enc.layers)
                layers, head = proxy.backbone_costs(bb, tp, mbs)
                for dp in range(1, cluster.devices // (tp * pp) + 1):
                    if workload.global_batch % (dp * mbs):
                        continue
                    split = exhaustive_split(model, workload, cluster.memory_limit, tp, dp, mbs, pp,
                                             vit.forward, layers.forward / bb.layers)
                    if split is None:
                        continue
                    skeleton = OneFOneB(stages=pp, layers=split[:-1] + (split[-1] + 1,))
                    plan = compose([Region("v", enc.layers, skeleton, trainable=enc.trainable),
                                    Region("l", bb.layers, skeleton), Region("h", 1, skeleton)],
                                   workload.global_batch // (dp * mbs))
                    result = simulate(plan, CostTable({"v": vit, "l": layers, "h": head},
                                                      link=proxy.stage_link(tp, pp)))
                    # peak_live counts region visits; each microbatch in flight holds all the
                    # trainable regions whose visits sit on the rank (read off microbatch 0's path)
                    held = {r: {v.region for v in plan.paths[0]
                                if v.rank == r and v.backward and v.backward_rank is None}
                            for r in result.peak_live}
                    live = [math.ceil(result.peak_live[r] / len(held[r])) if held[r] else 0
                            for r in sorted(result.peak_live)]
                    worst = 0.0
                    for stage, count in enumerate(split):
                        own = enc.layers if stage == 0 else 0
                        total = stage_memory(bb, layers=count - own, tp=tp, dp=dp, samples=mbs, live=live[stage],
                                             first=stage == 0, last=stage == pp - 1,
                                             distributed_optimizer=workload.distributed_optimizer).total
                        if own:
                            total += stage_memory(enc, layers=own, tp=tp, dp=dp, samples=mbs,
                                                  live=live[stage] if enc.trainable else 0, first=False, last=False,
                                                  distributed_optimizer=workload.distributed_optimizer).total
                        worst = max(worst, total)
                    if worst > cluster.memory_limit:
                        continue
                    stage0 = enc.params + (split[0] - enc.layers) * bb.layer_params + bb.vocab * bb.hidden
                    step = result.step_time + proxy.gradient_reduce_seconds(stage0, tp, dp)
                    out.append((workload.global_batch / step, tp * pp * dp))
    return out


def brute_force(model: ModelSpec, cluster: ClusterSpec, proxy: ProxyModel, workload: Workload):
    """Best (throughput, mismatch, devices) over every config pair (and every co-located
    config when the workload allows them), or None."""
    limit = cluster.memory_limit
    node = cluster.devices_per_node

    def tp_ok(spec, tp):
        return node % tp == 0 and spec.heads % tp == 0 and spec.query_groups % tp == 0

    encoders = []
    for tp, dp in itertools.product(workload.tp_choices, range(1, cluster.devices + 1)):
        if tp_ok(model.encoder, tp) and tp * dp <= cluster.devices \
                and workload.global_batch % (dp * workload.encoder_micro_batch) == 0:
            est = proxy.encoder(model.encoder, workload, tp, dp)
            if est.memory.total <= limit:
                encoders.append((est.rate, tp * dp, dp))
    backbones = []
    for tp, pp, mbs, dp in itertools.product(workload.tp_choices, workload.pp_choices,
                                             workload.micro_batch_choices, range(1, cluster.devices + 1)):
        if tp_ok(model.backbone, tp) and model.backbone.layers % pp == 0 and tp * pp * dp <= cluster.devices \
                and workload.global_batch % (dp * mbs) == 0:
            est = proxy.backbone(model.backbone, workload, tp, pp, mbs, dp)
            if est.memory.total <= limit:
                backbones.append((est.rate, tp * pp * dp, tp * pp, dp))

    def megatron_world(de, edp, block, bdp):  # the encoder fills whole blocks, its replicas split evenly
        blocks_ok = not workload.megatron_blocks or de % block == 0
        split_ok = not (workload.megatron_blocks or workload.encoder_split) or edp % bdp == 0
        return blocks_ok and split_ok

    def budget_ok(devices):
        return devices == cluster.devices if workload.exact_devices else devices <= cluster.devices

    pairs = [(min(p, c), abs(p - c), de + db) for (p, de, edp), (c, db, block, bdp)
             in itertools.product(encoders, backbones) if budget_ok(de + db) and megatron_world(de, edp, block, bdp)]
    if "colocated" in workload.placements:
        pairs += [(rate, 0.0, devices) for rate, devices in colocated_rates(model, cluster, proxy, workload)
                  if budget_ok(devices)]
    if not pairs:
        return None
    best_t = max(t for t, _, _ in pairs)
    pairs = [x for x in pairs if x[0] >= best_t * (1 - 1e-7)]
    best_m = min(m for _, m, _ in pairs)
    pairs = [x for x in pairs if x[1] <= best_m + 1e-7 * best_t]
    return best_t, best_m, min(d for _, _, d in pairs)


@pytest.mark.parametrize("runtime", [{}, {"megatron_blocks": True, "exact_devices": True},
                                     {"megatron_blocks": True}, {"exact_devices": True},
                                     {"encoder_split": True}, {"encoder_split": True, "exact_devices": True}],
                         ids=["free", "megatron-world", "megatron-blocks", "exact-devices", "encoder-split",
                              "decoupled-layout-world"])
def test_solve_matches_brute_force_on_random_instances(runtime):
    """The default problem (300 instances), and with the runtime requirements a fixed
    Megatron world imposes (100 instances each; the same seed, so the same instances)."""
    rng = random.Random(12)
    solved = infeasible = colocated = constrained = 0
    for case in range(100 if runtime else 300):
        model, cluster, proxy, workload = random_instance(rng)
        free = brute_force(model, cluster, proxy, workload) if runtime else None
        workload = dataclasses.replace(workload, **runtime)
        expected = brute_force(model, cluster, proxy, workload)
        if expected is None:
            with pytest.raises(InfeasibleError) as raised:
                solve(model, cluster, proxy, workload)
            if free is not None:  # only the requirements leave nothing: the diagnosis says so
                assert "runtime requirements" in str(raised.value), f"case {case}: {raised.value}"
                constrained += 1
            infeasible += 1
            continue
        plan = solve(model, cluster, proxy, workload)
        t, m, d = expected
        assert plan.throughput == pytest.approx(t, rel=1e-6), f"case {case}"
        assert plan.mismatch == pytest.approx(m, rel=1e-5, abs=1e-6 * t), f"case {case}"
        assert plan.devices == d, f"case {case}"
        assert plan.devices <= cluster.devices
        assert plan.throughput == pytest.approx(min(plan.predicted.production, plan.predicted.consumption))
        if workload.megatron_blocks and plan.placement == "decoupled":
            assert plan.encoder.devices % (plan.backbone.tp * plan.backbone.pp) == 0, f"case {case}"
        if (workload.megatron_blocks or workload.encoder_split) and plan.placement == "decoupled":
            assert plan.encoder.dp % plan.backbone.dp == 0, f"case {case}"
        if workload.exact_devices:
            assert plan.devices == cluster.devices, f"case {case}"
        solved += 1
        colocated += plan.placement == "colocated"
        constrained += free is not None and free != expected  # the requirement changed the optimum
    if runtime:  # every branch really exercised, and the requirements do bind
        assert solved >= 40 and infeasible >= 5 and constrained >= 10, (solved, infeasible, constrained)
    else:
        assert solved >= 150 and infeasible >= 10 and colocated >= 10  # every branch really exercised


def _big_model() -> ModelSpec:
    enc = ModuleSpec(layers=32, hidden=1280, heads=16, ffn=3456, tokens_per_sample=4096)
    bb = ModuleSpec(layers=80, hidden=8192, heads=64, ffn=29568, query_groups=8, tokens_per_sample=4096,
                    vocab=152064)
    return ModelSpec(enc, bb)


def test_device_budget_shortfall_is_named_with_the_amount():
    """Each module fits alone (encoder tp 8 x dp 1, backbone tp 8 x pp 4), together they need
    40 devices: the diagnosis names the pair and the shortfall of 1."""
    model = _big_model()
    cluster = ClusterSpec(devices=39, memory_gib=80)
    workload = Workload(global_batch=64, pp_choices=(4, 8), tp_choices=(8,), micro_batch_choices=(1,),
                        placements=("decoupled",))
    proxy = ProxyModel(synthetic_profile(random.Random(1)), cluster)
    with pytest.raises(InfeasibleError) as info:
        solve(model, cluster, proxy, workload)
    assert info.value.reasons == [
        "device budget: the smallest plan needs 40 devices (encoder tp 8 dp 1: 8 + backbone tp 8 pp 4 dp 1: 32), "
        "the budget is 39: short by 1"]
    assert solve(model, ClusterSpec(devices=40, memory_gib=80), proxy, workload).devices == 40


def test_memory_limit_diagnosis_names_the_closest_config_and_the_excess():
    model = _big_model()
    cluster = ClusterSpec(devices=64, memory_gib=24)
    workload = Workload(global_batch=32, pp_choices=(1, 2), tp_choices=(2, 4), micro_batch_choices=(1,))
    proxy = ProxyModel(synthetic_profile(random.Random(2)), cluster)
    with pytest.raises(InfeasibleError) as info:
        solve(model, cluster, proxy, workload)
    reasons = "\n".join(info.value.reasons)
    assert "no backbone configuration is feasible" in reasons
    # 72B over tp 4 x pp 2 is 9 B parameters per device: far over 24 GiB.
    assert "memory" in reasons and "over by" in reasons and "tp 4 pp 2" in reasons


def test_tp_must_fit_in_a_node_and_divide_the_heads():
    model = _big_model()
    cluster = ClusterSpec(devices=512, devices_per_node=4, memory_gib=80)
    workload = Workload(global_batch=64, pp_choices=(8,), tp_choices=(8, 16), micro_batch_choices=(1,))
    proxy = ProxyModel(synthetic_profile(random.Random(3)), cluster)
    with pytest.raises(InfeasibleError) as info:
        solve(model, cluster, proxy, workload)
    assert "tp-in-node" in str(info.value) and "tp 8: tp-in-node: 8 vs 4 devices per node" in str(info.value)


def test_memory_pruning_removes_exactly_the_configs_that_do_not_fit():
    """Lowering the memory limit removes the configs between the two limits, and the plan
    under the low limit is the best of those that fit it (checked against brute force)."""
    model = _big_model()
    workload = Workload(global_batch=32, pp_choices=(2, 4, 8), tp_choices=(4, 8), micro_batch_choices=(1, 2))
    profile = synthetic_profile(random.Random(4))
    roomy = ClusterSpec(devices=256, memory_gib=192)
    roomy_plan = solve(model, roomy, ProxyModel(profile, roomy), workload)
    limit = roomy_plan.predicted.backbone_memory_gib * 0.9 / (1 - roomy.memory_reserve)
    tight = ClusterSpec(devices=256, memory_gib=limit)
    tight_proxy = ProxyModel(profile, tight)
    tight_plan = solve(model, tight, tight_proxy, workload)
    assert tight_plan.predicted.backbone_memory_gib * GIB <= tight.memory_limit
    assert tight_plan.backbone != roomy_plan.backbone  # the roomy choice no longer fits
    # The co-located split is the forward-balanced one within what memory allows, so a
    # tighter limit can pick a split the simulator finds marginally faster (not better
    # balanced by forward): no more than that.
    assert tight_plan.throughput <= roomy_plan.throughput * (1 + 1e-3)
    expected = brute_force(model, tight, tight_proxy, workload)
    assert tight_plan.throughput == pytest.approx(expected[0], rel=1e-6)
    for alt in tight_plan.alternatives:
        assert alt.predicted.backbone_memory_gib * GIB <= tight.memory_limit
        assert alt.throughput <= tight_plan.throughput * (1 + 1e-7)


def test_colocated_only_diagnosis_names_the_colocated_configs_not_unasked_backbones():
    """With only the co-located placement, a backbone that would fit alone is no reason;
    the co-located config that misses memory is named with its excess, and one that
    exceeds the budget with its devices."""
    model = _big_model()
    workload = Workload(global_batch=64, pp_choices=(8,), tp_choices=(8,), micro_batch_choices=(1,),
                        placements=("colocated",))
    cluster = ClusterSpec(devices=64, memory_gib=30)
    proxy = ProxyModel(synthetic_profile(random.Random(1)), cluster)
    with pytest.raises(InfeasibleError) as info:
        solve(model, cluster, proxy, workload)
    assert len(info.value.reasons) == 2 and "backbone" not in str(info.value)
    assert "colocated tp 8 pp 8 mbs 1 dp 1: memory: needs" in info.value.reasons[1]
    small = ClusterSpec(devices=32, memory_gib=80)
    with pytest.raises(InfeasibleError, match="colocated tp 8 pp 8: devices: 64 vs 32 devices"):
        solve(model, small, ProxyModel(synthetic_profile(random.Random(1)), small), workload)


def test_backbone_reach_bounds_every_decoupled_pair_it_can_join():
    """A backbone is simulated only if its reach (rate bound capped by the fastest encoder
    on the devices it leaves) attains the best plan so far; that is safe because no pair
    within the budget runs faster than its backbone's reach.  Checked against every pair,
    with the backbone simulated, on random instances (some backbones leave room for no
    encoder at all: reach 0)."""
    from mindspeed_flow.allocator.candidates import candidates

    rng = random.Random(21)
    pairs = unpaired = 0
    for _ in range(25):
        model, cluster, proxy, workload = random_instance(rng)
        found, pool = candidates(model.encoder, model.backbone, cluster, workload, proxy)
        for p in pool.pending:
            fitting = [e.rate for e in found.encoders if e.devices + p.devices <= cluster.devices]
            assert p.reach == min(p.bound, max(fitting, default=0.0))
            rate = proxy.backbone(model.backbone, workload, p.tp, p.pp, p.micro_batch, p.dp).rate
            for enc_rate in fitting:
                assert min(enc_rate, rate) <= p.reach * (1 + 1e-12)
                pairs += 1
            unpaired += not fitting
    assert pairs >= 200 and unpaired >= 5
