"""scripts/bench_flow.py's simulator side: the runtime costs it measures reach every layout's
prediction where the layout pays them, and its runtime probe times what it says it does.
(The bench's measured side launches 32 processes: it is run by hand, docs/flow.md "Measured".)"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.support.scripts import import_script


@pytest.fixture(scope="module")
def bench():
    """``scripts/bench_flow.py`` as the module ``bench_flow`` (spawned children import it by name)."""
    return import_script("bench_flow")


def _args(bench, backbone: str, action_s: float, link_s: float, post_s: float = 0.0):
    args = bench.build_parser().parse_args(["--vit-us", "100", "--backbone", backbone, "--steps", "2"])
    args.transfer_s, args.action_s, args.link_s, args.post_s = 400e-6, action_s, link_s, post_s
    return args


@pytest.mark.parametrize("frozen", [False, True])
def test_every_layout_pays_the_per_action_overhead(bench, frozen):
    free, charged = _args(bench, "2x1", 0.0, 0.0), _args(bench, "2x1", 1e-3, 0.0)
    for layout in bench.LAYOUTS:
        if layout == "flow" and frozen:
            before, after = bench.predicted_frozen_flow(free), bench.predicted_frozen_flow(charged)
        else:
            before, after = bench.predicted(free, layout, frozen, 1), bench.predicted(charged, layout, frozen, 1)
        assert after > before, (layout, before, after)


@pytest.mark.parametrize("latency, post", [(5e-3, 0.0), (0.0, 2e-3)])
def test_only_a_pipelined_backbone_pays_the_stage_to_stage_transfer(bench, latency, post):
    for backbone, pipelined in (("2x1", True), ("1x2", False)):
        free, linked = _args(bench, backbone, 0.0, 0.0), _args(bench, backbone, 0.0, latency, post)
        free.steps = linked.steps = 1  # frozen: the flow's one step is the backbone's alone (nothing runs ahead)
        pairs = {"flow": (bench.predicted_frozen_flow(free), bench.predicted_frozen_flow(linked)),
                 "lockstep": (bench.predicted(free, "lockstep", True, 1), bench.predicted(linked, "lockstep", True, 1))}
        for layout, (before, after) in pairs.items():
            assert (after > before) is pipelined and after >= before, (backbone, layout, before, after)
    free, linked = _args(bench, "2x1", 0.0, 0.0), _args(bench, "2x1", 0.0, latency, post)
    assert bench.predicted(linked, "stage0-pp2", True, 1) > bench.predicted(free, "stage0-pp2", True, 1)
    assert bench.predicted(linked, "stage0-pp1", True, 1) == bench.predicted(free, "stage0-pp1", True, 1)


def test_frozen_flow_backbone_does_not_pay_for_forwards_encoded_the_step_before(bench):
    # With the producers' next-step forwards out of the way (one measured step: nothing runs
    # ahead in it), the frozen flow's step is the backbone's alone, and an overhead on the
    # encoder's already-encoded forwards would show in it: it must equal the backbone's
    # simulated step with the encoder free of it.
    args = _args(bench, "2x1", 1e-3, 1e-3, 5e-4)
    args.steps = 1
    from mindspeed_flow.flow import EncoderCost, compose_flow, flow_costs
    from mindspeed_flow.schedule import simulate

    vit, llm = bench.region_costs(args, frozen=True)
    link, pool = bench.links(args)
    g = bench.grouping(args, 1)
    llm_cost, _ = bench.models(args)
    alone = simulate(compose_flow(g, trainable_encoder=False),
                     flow_costs(g, llm_cost=llm_cost, encoder_cost=EncoderCost(), encoder=replace(vit, overhead=0.0),
                                backbone=llm, link=link, pool=pool, token_bytes=bench.DIM * 4)).step_time
    assert bench.predicted_frozen_flow(args) == pytest.approx(alone)


def test_runtime_probe_orders_each_transfer_after_its_senders_compute(bench):
    first, last = bench.launch(bench._runtime_probe, 2, timeout_s=120)
    assert len(first) == len(last) == bench.PROBE_STEPS
    for (f0, f0_end, b0, b0_end, send0), (f1, f1_end, b1, b1_end, send1) in zip(first, last):
        # stage 1's forward needs stage 0's activation, stage 0's backward stage 1's gradient
        assert f0 <= f0_end <= f1 <= f1_end <= b1 <= b1_end <= b0 <= b0_end
        assert 0 <= send0 <= b0 - f0_end and 0 <= send1  # stage 0's send is between its computes
