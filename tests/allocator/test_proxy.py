"""The proxy: its pipeline bubble is the schedule simulator's, its rates react to what
they should, and profiles survive a round trip through their files."""

from __future__ import annotations

import itertools
import math
import random
from pathlib import Path

import pytest

from mindspeed_flow.allocator import (AllocatorError, ClusterSpec, ModelSpec, ModuleSpec, Profile, ProfilePoint,
                                      ProxyModel, Workload)
from mindspeed_flow.allocator.colocated import colocated_memory, planned_live
from mindspeed_flow.allocator.memory import layer_activation_bytes
from mindspeed_flow.allocator.pipeline import HEAD_REGION, LAYERS_REGION, PipelineLayout, backbone_layout, composed, pipeline_step, steady_line
from mindspeed_flow.schedule import CostTable, Link, OneFOneB, Region, RegionCost, compose, simulate, validate

from tests.allocator.test_solve import synthetic_profile

BACKBONE = ModuleSpec(layers=24, hidden=2048, heads=16, ffn=8192, query_groups=4, tokens_per_sample=2048,
                      vocab=32000)
CLUSTER = ClusterSpec(devices=256, devices_per_node=8, memory_gib=80)


@pytest.fixture(scope="module")
def proxy() -> ProxyModel:
    return ProxyModel(synthetic_profile(random.Random(5)), CLUSTER)


def _simulated_directly(proxy: ProxyModel, tp: int, pp: int, mbs: int, microbatches: int):
    """Compose and simulate the backbone layout here, from the proxy's per-layer times."""
    forward, backward = proxy.layer_seconds("backbone", BACKBONE, tp, mbs)
    head = proxy.head_cost(BACKBONE, tp, mbs)
    per_stage = BACKBONE.layers // pp
    skeleton = OneFOneB(stages=pp, layers=(per_stage,) * (pp - 1) + (per_stage + 1,))
    plan = compose([Region("decoder", BACKBONE.layers, skeleton), Region("lm_head", 1, skeleton)], microbatches)
    validate(plan)
    sent = 2 * mbs * BACKBONE.tokens_per_sample * BACKBONE.hidden / tp
    table = CostTable({
        "decoder": RegionCost(forward=BACKBONE.layers * forward, backward_ratio=backward / forward,
                              output_bytes=sent),
        "lm_head": RegionCost(forward=head.forward, backward_ratio=head.backward_ratio, output_bytes=sent),
    }, link=proxy.inter if tp * pp > CLUSTER.devices_per_node else proxy.intra)
    return simulate(plan, table)


@pytest.mark.parametrize("tp,pp,mbs,dp", [(1, 1, 1, 4), (2, 2, 1, 8), (4, 4, 2, 2), (8, 3, 1, 1), (2, 8, 1, 2),
                                          (4, 6, 1, 16)])
def test_bubble_and_step_are_the_simulators(proxy, tp, pp, mbs, dp):
    workload = Workload(global_batch=64)
    est = proxy.backbone(BACKBONE, workload, tp, pp, mbs, dp)
    direct = _simulated_directly(proxy, tp, pp, mbs, est.microbatches)
    assert est.microbatches == 64 // (dp * mbs)
    assert est.bubble_fraction == pytest.approx(direct.bubble_fraction, rel=1e-9, abs=1e-12)
    reduce = proxy.gradient_reduce_seconds(
        est.split[0] * BACKBONE.layer_params + BACKBONE.vocab * BACKBONE.hidden * (2 if pp == 1 else 1), tp, dp)
    assert est.step_time == pytest.approx(direct.step_time + reduce, rel=1e-9)
    assert est.rate == pytest.approx(64 / est.step_time)


def test_long_steps_extend_the_simulated_line_exactly(proxy):
    """Beyond ``3 pp`` microbatches the proxy reads steps off a simulated line; simulating
    all of them agrees."""
    for pp, microbatches in ((2, 40), (2, 7), (4, 13), (4, 33), (6, 64), (3, 10)):
        extended = proxy.pipeline(BACKBONE, 2, pp, 1, microbatches)
        direct = _simulated_directly(proxy, 2, pp, 1, microbatches)
        assert extended.step_time == pytest.approx(direct.step_time, rel=1e-12)
        assert extended.bubble_fraction == pytest.approx(direct.bubble_fraction, rel=1e-9)
        assert extended.peak_live == tuple(min(pp - s, microbatches) for s in range(pp))  # 1F1B, by hand


def test_transfer_bound_pipelines_are_simulated_in_full():
    """Half-second transfers between 1.6 s stages: no per-microbatch rhythm, so the line
    check fails and every step is the full simulation."""
    layout = backbone_layout(48, 8, True)
    costs = (RegionCost(forward=1.6, backward_ratio=2.1, output_bytes=1e6),
             RegionCost(forward=0.3, backward_ratio=1.8, output_bytes=1e6))
    link = Link(0.5, 1e6)
    assert steady_line(layout, costs, link) is None
    for microbatches in (8, 19, 26):
        direct = simulate(composed(layout, microbatches), CostTable(dict(zip(("layers", "head"), costs)), link=link))
        assert pipeline_step(layout, microbatches, costs, link).step_time == pytest.approx(direct.step_time, rel=1e-12)


def test_rates_respond_to_tp_communication_dp_reduction_and_memory(proxy):
    workload = Workload(global_batch=64)
    slow_link = ProxyModel(proxy.profile, ClusterSpec(devices=256, intra_node_gbps=5, memory_gib=80))
    # TP communication: a slower intra-node link slows tp=4 but not tp=1 (one stage, one
    # replica: nothing else crosses a link).
    assert slow_link.backbone(BACKBONE, workload, 4, 1, 1, 1).step_time > \
        proxy.backbone(BACKBONE, workload, 4, 1, 1, 1).step_time
    assert slow_link.backbone(BACKBONE, workload, 1, 1, 1, 1).step_time == pytest.approx(
        proxy.backbone(BACKBONE, workload, 1, 1, 1, 1).step_time)
    # TP efficiency loss: tp=8 does not reach 8x the per-replica rate of tp=1.
    one, eight = (proxy.backbone(BACKBONE, workload, tp, 1, 1, 1) for tp in (1, 8))
    assert 1 < eight.rate / one.rate < 8
    # DP: more replicas, more samples/s, but the gradient all-reduce keeps it sub-linear.
    assert proxy.backbone(BACKBONE, workload, 2, 2, 1, 8).rate < 8 * proxy.backbone(BACKBONE, workload, 2, 2, 1, 1).rate
    # Memory: activations grow with the microbatches in flight (more with more stages on
    # stage 0), states shrink with the distributed optimizer's DP sharding.
    assert proxy.backbone(BACKBONE, workload, 2, 4, 2, 1).memory.activations > \
        proxy.backbone(BACKBONE, workload, 2, 4, 1, 1).memory.activations
    assert proxy.backbone(BACKBONE, workload, 2, 2, 1, 8).memory.states < \
        proxy.backbone(BACKBONE, workload, 2, 2, 1, 1).memory.states


def test_efficiency_interpolates_between_measured_points_and_is_flat_outside():
    points = [ProfilePoint(m, 1, 1, 64, 2, 1.0, 2.0, f) for m in ("encoder", "backbone") for f in (1e9, 1e11)]
    proxy = ProxyModel(Profile("t", 1.0, points), CLUSTER)
    low, high = (3 * f / 3.0 / 1e12 for f in (1e9, 1e11))  # achieved / peak at both points
    per_layer = (5e8, 5e10)  # the points measured two layers
    assert proxy.efficiency("backbone", per_layer[0]) == pytest.approx(low)
    assert proxy.efficiency("backbone", per_layer[1]) == pytest.approx(high)
    assert proxy.efficiency("backbone", 5e9) == pytest.approx((low + high) / 2)  # halfway in log
    assert proxy.efficiency("backbone", 1.0) == pytest.approx(low)
    assert proxy.efficiency("backbone", 1e20) == pytest.approx(high)


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_profile_round_trip(tmp_path, suffix):
    profile = synthetic_profile(random.Random(9))
    path = profile.save(tmp_path / f"p{suffix}")
    again = Profile.load(path)
    assert again == profile
    assert [p.achieved_flops for p in again.points] == [p.achieved_flops for p in profile.points]


def test_bad_profile_names_the_file_and_point(tmp_path):
    data = synthetic_profile(random.Random(9)).to_dict()
    data["points"][3]["forward_s"] = -1
    path = tmp_path / "bad.yaml"
    import yaml

    path.write_text(yaml.safe_dump(data))
    with pytest.raises(AllocatorError, match=r"bad.yaml: points\[3\]: forward_s must be > 0"):
        Profile.load(path)
    del data["points"][3]["forward_s"]
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(AllocatorError, match=r"points\[3\]: missing forward_s"):
        Profile.load(path)


def test_rate_bound_is_never_below_the_simulated_rate(proxy):
    """The bound that lets the solver skip simulations holds for every config, and is
    tight for one stage (no bubble, one replica)."""
    workload = Workload(global_batch=48)
    for tp in (1, 2, 8):
        for pp in (1, 2, 3, 4, 6, 8):
            for mbs, dp in ((1, 1), (2, 3), (1, 12), (1, 48)):
                rate = proxy.backbone(BACKBONE, workload, tp, pp, mbs, dp).rate
                assert proxy.backbone_rate_bound(BACKBONE, workload, tp, pp, mbs, dp) >= rate * (1 - 1e-12)
    assert proxy.backbone_rate_bound(BACKBONE, workload, 2, 1, 1, 1) == pytest.approx(
        proxy.backbone(BACKBONE, workload, 2, 1, 1, 1).rate)


CPU_PROFILE = Path(__file__).resolve().parents[2] / "configs/allocator/profiles/cpu_megatron_tiny.yaml"
# The block shapes scripts/profile_allocator.py measured (its ENCODER / BACKBONE).
PROFILED_SHAPES = {"encoder": dict(hidden=320, heads=4, ffn=864, query_groups=4),
                   "backbone": dict(hidden=512, heads=8, ffn=1408, query_groups=4)}
REPRODUCE_TOLERANCE = 1e-9  # relative error of forward + backward at every measured point


def _profiled_cluster(profile: Profile) -> ClusterSpec:
    """The machine the profile was measured on: its peak, and TP over the profile's link."""
    return ClusterSpec(devices=8, devices_per_node=8, peak_tflops=profile.peak_tflops,
                       intra_node_gbps=profile.tp_link_gbps, latency_us=profile.tp_link_latency_us)


def test_proxy_returns_the_measured_time_at_every_measured_point_tp4_included():
    """At each point of the stored CPU profile (TP 1, 2 and 4, all measured) the calibrated
    proxy, on the machine the profile was taken on, returns the measured forward + backward
    time; the calibration has a curve for every measured TP size of both modules; the
    formula-only model (no fitted factor) misses the TP > 1 points by far more."""
    profile = Profile.load(CPU_PROFILE)
    proxy = ProxyModel(profile, _profiled_cluster(profile))
    formula_errors = []
    assert {p.tp for p in profile.points} == {1, 2, 4}
    assert {m: sorted(c) for m, c in proxy.calibration.curves.items()} == {"encoder": [1, 2, 4],
                                                                          "backbone": [1, 2, 4]}
    for p in profile.points:
        spec = ModuleSpec(layers=p.layers, tokens_per_sample=p.seq, **PROFILED_SHAPES[p.module])
        assert spec.hidden == p.hidden
        assert p.layers * spec.layer_forward_flops(p.micro_batch) / p.tp == pytest.approx(p.flops)
        forward, backward = proxy.layer_seconds(p.module, spec, p.tp, p.micro_batch)
        measured = p.forward_s + p.backward_s
        assert p.layers * (forward + backward) == pytest.approx(measured, rel=REPRODUCE_TOLERANCE), p
        compute = proxy.compute_seconds(p.module, p.flops / p.layers)
        comm = proxy.tp_comm_seconds(proxy.intra, p.tp, p.micro_batch * p.seq * p.hidden)
        formula = p.layers * ((1 + proxy._backward_ratio[p.module]) * compute + 2 * comm)
        if p.tp > 1:
            formula_errors.append(abs(formula / measured - 1))
    assert max(formula_errors) > 0.1


def _tp_profile(factors: dict[int, float]) -> Profile:
    """One work size per TP size; TP ``tp`` runs ``factors[tp]`` times slower than the
    tp=1 efficiency (backward exactly 2x forward, so the median ratio is 2)."""
    points = []
    for module in ("encoder", "backbone"):
        for tp, slow in factors.items():
            forward = 1e9 / (0.5 * 1e12) * slow
            points.append(ProfilePoint(module, tp, 1, 64, 1, forward, 2 * forward, 1e9, hidden=64))
    return Profile("t", 1.0, points, tp_link_gbps=1e9)


def test_tp_factor_is_interpolated_in_log_tp_and_extrapolated_from_every_measured_size():
    """Measured TP sizes give their own factors, sizes between them are linear in log tp,
    and beyond the largest the least-squares slope over all measured sizes continues from
    it: with factors 1, 1.5, 2.5 at TP 1, 2, 4 the slope is 0.75 per doubling, so TP 8 is
    3.25 (TP 2 and 4 alone would give 3.5, holding TP 4 2.5)."""
    proxy = ProxyModel(_tp_profile({1: 1.0, 2: 1.5, 4: 2.5}), CLUSTER)
    factor = proxy.calibration.factor
    assert sorted(proxy.calibration.curves["backbone"]) == [1, 2, 4]
    for tp, measured in ((1, 1.0), (2, 1.5), (4, 2.5)):
        assert factor("backbone", tp, 1e9) == pytest.approx(measured, rel=1e-9)
    assert factor("backbone", 3, 1e9) == pytest.approx(1.5 + 1.0 * math.log2(1.5), rel=1e-9)  # log tp
    assert factor("backbone", 8, 1e9) == pytest.approx(3.25, rel=1e-9)
    assert factor("encoder", 16, 1e12) == pytest.approx(4.0, rel=1e-9)  # two doublings on, flat in work
    falling = ProxyModel(_tp_profile({1: 1.0, 2: 0.8, 4: 0.7}), CLUSTER).calibration.factor
    assert falling("backbone", 8, 1e9) == pytest.approx(0.7, rel=1e-9)  # a falling trend is held
    single = ProxyModel(_tp_profile({1: 1.0}), CLUSTER).calibration.factor
    assert single("backbone", 8, 1e9) == pytest.approx(1.0, rel=1e-9)  # TP 1 only: every size uses it


def test_tp_points_without_a_hidden_size_or_link_are_named():
    points = list(_tp_profile({1: 1.0, 2: 1.5}).points)
    points[1] = ProfilePoint("encoder", 2, 1, 64, 1, 0.01, 0.02, 1e9)
    with pytest.raises(AllocatorError, match=r"points\[1\] \(tp=2\) has no hidden size"):
        ProxyModel(Profile("t", 1.0, points, tp_link_gbps=1.0), CLUSTER)
    with pytest.raises(AllocatorError, match="tp > 1 points but no tp_link_gbps"):
        Profile("t", 1.0, points)


def test_memory_charges_each_part_once_per_microbatch_in_flight(proxy):
    """Co-located 1F1B over 4 stages, 8 microbatches: stage 0 holds the ViT and 2 LLM
    layers, the last 3 LLM layers and the head.  By hand, stage ``s`` holds ``4 - s``
    microbatches at the peak, and each part's activations are charged that many times,
    not once per region visit (which would double stage 0 and the last stage)."""
    vit = ModuleSpec(layers=4, hidden=1024, heads=16, ffn=4096, query_groups=16, tokens_per_sample=256)
    model = ModelSpec(vit, BACKBONE)
    split = (vit.layers + 2, 10, 9, 3)  # ViT + LLM layers per stage
    layout = PipelineLayout((("vit", vit.layers, True), (LAYERS_REGION, BACKBONE.layers, True),
                             (HEAD_REGION, 1, True)), split[:-1] + (split[-1] + 1,))
    costs = (proxy.region_cost("encoder", vit, 2, 1, vit.layers),) + proxy.backbone_costs(BACKBONE, 2, 1)
    step = pipeline_step(layout, 8, costs, proxy.intra)
    assert step.peak_live == (4, 3, 2, 1) == planned_live(4, 8)
    workload = Workload(global_batch=8)
    llm_layer, vit_layer = (layer_activation_bytes(m, 1, 2) for m in (BACKBONE, vit))
    logits = 4 * BACKBONE.tokens_per_sample * BACKBONE.vocab / 2
    for stage, expected in ((0, 4 * (vit.layers * vit_layer + 2 * llm_layer)), (3, 1 * 3 * llm_layer + logits)):
        only = tuple(layers if s == stage else 0 for s, layers in enumerate((2, 10, 9, 3)))
        charged = colocated_memory(model, workload, 2, 1, 1, (vit.layers + only[0],) + only[1:], step.peak_live)
        assert charged.activations == pytest.approx(expected, rel=1e-12)
    est = proxy.backbone(BACKBONE, workload, 2, 4, 1, 1)  # decoupled: head on the last stage
    assert proxy.pipeline(BACKBONE, 2, 4, 1, 8).peak_live == (4, 3, 2, 1)
    assert est.memory.activations == pytest.approx(4 * 6 * llm_layer, rel=1e-12)


def test_planned_live_is_the_simulated_in_flight(proxy):
    """Backbones over memory are rejected before simulating, with ``planned_live`` as the
    microbatches in flight; that is safe only if the simulator never reports fewer.  It
    reports exactly as many: backbone layouts (LLM layers + head) and co-located ones
    (ViT trained or frozen + layers + head), fewer and more microbatches than stages."""
    from mindspeed_flow.allocator.pipeline import in_flight, planned_live, simulated

    vit = ModuleSpec(layers=4, hidden=1024, heads=16, ffn=4096, query_groups=16, tokens_per_sample=256)
    costs = (proxy.region_cost("encoder", vit, 2, 1, vit.layers),) + proxy.backbone_costs(BACKBONE, 2, 1)
    for pp in (1, 2, 3, 4, 6, 8):
        for microbatches in sorted({1, pp - 1, pp, pp + 1, 2 * pp + 3} - {0}):
            step = simulated(backbone_layout(BACKBONE.layers, pp, True), microbatches, costs[1:], proxy.intra)
            assert step.peak_live == planned_live(pp, microbatches), (pp, microbatches)
            for trained in (True, False):
                per = (BACKBONE.layers - 2) // pp
                llm = (2,) + (per,) * (pp - 2) + (BACKBONE.layers - 2 - per * (pp - 2),) if pp > 1 else (24,)
                split = (vit.layers + llm[0],) + llm[1:]
                layout = PipelineLayout((("vit", vit.layers, trained), (LAYERS_REGION, BACKBONE.layers, True),
                                         (HEAD_REGION, 1, True)), split[:-1] + (split[-1] + 1,))
                step = simulated(layout, microbatches, costs, proxy.intra)
                assert step.peak_live == planned_live(pp, microbatches), (pp, microbatches, trained)
    # in_flight does the dividing: stage 0 of a 2-region stage with 6 visits holds 3 microbatches.
    layout = PipelineLayout((("vit", 4, True), (LAYERS_REGION, 8, True), (HEAD_REGION, 1, True)), (6, 7))
    assert in_flight(layout, (6, 2)) == (3, 1)


@pytest.mark.parametrize("optimizer,trained", [(True, True), (False, True), (True, False)])
def test_memory_over_many_replica_counts_equals_one_at_a_time(proxy, optimizer, trained):
    """The pools check every replica count of a shape in one numpy pass; each entry is the
    scalar estimate of that count, bit for bit (the fullest stage chosen per count)."""
    import numpy as np

    from mindspeed_flow.allocator.colocated import layer_caps
    from mindspeed_flow.allocator.pipeline import planned_live

    vit = ModuleSpec(layers=4, hidden=1024, heads=16, ffn=4096, query_groups=16, tokens_per_sample=256,
                     trainable=trained)
    model, workload = ModelSpec(vit, BACKBONE), Workload(global_batch=96, distributed_optimizer=optimizer)
    backbone = BACKBONE if trained else ModuleSpec(**{**BACKBONE.__dict__, "trainable": False})
    dps = np.array([1, 2, 3, 4, 6, 8, 12, 16, 24, 48, 96])
    seen_caps = set()
    for (tp, pp, mbs), limit in itertools.product(((1, 1, 1), (2, 4, 1), (4, 6, 2), (8, 8, 1)),
                                                  (1.5 * 2**30, 4 * 2**30, 30 * 2**30)):
        micro = 96 // (dps * mbs)
        many = proxy.backbone_memory(backbone, workload, tp, pp, mbs, dps, planned_live(pp, micro))
        caps = layer_caps(model, workload, limit, tp, dps, mbs, pp, micro)
        seen_caps.update(int(c) for cap in caps for c in cap)
        split = (vit.layers + 3,) + (3,) * (pp - 2) + (BACKBONE.layers - 3 * (pp - 1),) if pp > 1 else (28,)
        joint = colocated_memory(model, workload, tp, dps, mbs, split, planned_live(pp, micro))
        for i, dp in enumerate(dps.tolist()):
            one = proxy.backbone_memory(backbone, workload, tp, pp, mbs, dp, planned_live(pp, int(micro[i])))
            assert (np.broadcast_to(many.states, dps.shape)[i], np.broadcast_to(many.activations, dps.shape)[i]) \
                == (one.states, one.activations)
            assert tuple(int(c[i]) for c in caps) == layer_caps(model, workload, limit, tp, dp, mbs, pp,
                                                                 int(micro[i]))
            alone = colocated_memory(model, workload, tp, dp, mbs, split, planned_live(pp, int(micro[i])))
            assert np.broadcast_to(joint.total, dps.shape)[i] == alone.total
    assert len(seen_caps) >= 5 and min(seen_caps) < 0 and 24 in seen_caps  # none fits, some, all
