"""The simulator against closed forms, and its cost model hooks and chart."""

from __future__ import annotations

import pytest

from mindspeed_flow.schedule import (
    CostTable,
    Decoupled,
    GPipe,
    Interleaved1F1B,
    Jitter,
    Kind,
    Link,
    OneFOneB,
    Region,
    RegionCost,
    Transpose,
    compose,
    simulate,
)
from mindspeed_flow.schedule.costs import pack_scale
from mindspeed_flow.schedule.gantt import draw

# Stage forward 1 s and backward 2 s on four stages: the whole region's forward is 4 s.
FOUR_STAGES = CostTable({"llm": RegionCost(forward=4.0, stored_bytes=4 * 2**30)})


def test_1f1b_step_time_bubble_and_memory_match_the_closed_form():
    stages, microbatches = 4, 8
    result = simulate(compose([Region("llm", 8, OneFOneB(stages=stages))], microbatches), FOUR_STAGES)
    assert result.step_time == pytest.approx((microbatches + stages - 1) * 3.0)
    assert result.bubble_fraction == pytest.approx((stages - 1) / (microbatches + stages - 1))
    assert result.utilisation == pytest.approx({r: 24 / 33 for r in range(stages)})
    assert result.peak_live == {0: 4, 1: 3, 2: 2, 3: 1}  # stage s holds stages - s microbatches
    assert result.peak_bytes[0] == pytest.approx(4 * 2**30)  # 4 microbatches x a quarter each


def test_per_action_overhead_is_paid_once_per_compute_whatever_its_scale_or_share():
    # Every forward (1 s a stage) and backward (2 s) of 1F1B pays the overhead: each of the
    # microbatches + stages - 1 slots of the closed form grows by two overheads.
    stages, microbatches, overhead = 4, 8, 0.25
    costs = CostTable({"llm": RegionCost(forward=4.0, overhead=overhead)})
    result = simulate(compose([Region("llm", 8, OneFOneB(stages=stages))], microbatches), costs)
    assert result.step_time == pytest.approx((microbatches + stages - 1) * (3.0 + 2 * overhead))
    assert result.busy[0] == pytest.approx(microbatches * (3.0 + 2 * overhead))
    # Not scaled by a microbatch's cost: microbatch m's compute is m times the forward, plus the overhead.
    scaled = CostTable({"llm": RegionCost(forward=1.0, overhead=overhead)}, microbatch_scale=lambda region, m: m)
    one_rank = simulate(compose([Region("llm", 1, OneFOneB(stages=1))], 4), scaled)
    assert one_rank.step_time == pytest.approx(3.0 * (0 + 1 + 2 + 3) + 2 * 4 * overhead)
    assert [i.end - i.start for i in one_rank.intervals if i.action.kind is Kind.FORWARD] == pytest.approx(
        [m + overhead for m in range(4)])


def test_a_ranks_own_part_of_each_send_and_receive_delays_that_rank():
    # 2 stages, 1 s forward a stage; the activation crosses in 0.25 s and each end spends
    # 0.5 s of its own on its send or receive: stage 0's second forward starts after its
    # first send's part, stage 1's first forward after the arrival plus its receive's part.
    latency, post = 0.25, 0.5
    costs = CostTable({"llm": RegionCost(forward=2.0, output_bytes=1)}, link=Link(latency=latency, post=post))
    result = simulate(compose([Region("llm", 2, GPipe(stages=2))], 2), costs)
    forwards = {(i.rank, i.action.microbatch): i.start for i in result.intervals if i.action.kind is Kind.FORWARD}
    assert forwards[(0, 1)] == pytest.approx(1.0 + post)
    assert forwards[(1, 0)] == pytest.approx(1.0 + latency + post)
    # stage 1 asks for the second activation after its first forward (2.75 s), as it arrives
    # (sent at 2.5 s): its receive's part follows
    assert forwards[(1, 1)] == pytest.approx(1.0 + latency + post + 1.0 + post)
    free = simulate(compose([Region("llm", 2, GPipe(stages=2))], 2), CostTable({"llm": RegionCost(forward=2.0)}))
    assert result.step_time > free.step_time


def test_gpipe_has_the_same_step_but_holds_every_microbatch():
    result = simulate(compose([Region("llm", 8, GPipe(stages=4))], 8), FOUR_STAGES)
    assert result.step_time == pytest.approx(33.0)
    assert result.peak_live == {r: 8 for r in range(4)}


def test_interleaving_shrinks_the_bubble():
    costs = CostTable({"llm": RegionCost(forward=4.0)})
    plain = simulate(compose([Region("llm", 8, OneFOneB(stages=2))], 8), costs)
    interleaved = simulate(compose([Region("llm", 8, Interleaved1F1B(stages=2, chunks_per_rank=2))], 8), costs)
    assert plain.step_time == pytest.approx((8 + 1) * 6.0)
    assert interleaved.step_time < plain.step_time
    assert sum(interleaved.busy.values()) == pytest.approx(sum(plain.busy.values()))


@pytest.mark.parametrize("semantics", ["eager", "rendezvous"])
def test_transfer_time_is_bytes_over_bandwidth(semantics):
    # stage F 1 s, B 2 s; every transfer 1 s (1 GB at 1 GB/s)
    costs = CostTable({"llm": RegionCost(forward=2.0, output_bytes=1e9)}, link=Link(latency=0.0, bandwidth=1e9))
    result = simulate(compose([Region("llm", 2, OneFOneB(stages=2))], 1, semantics=semantics), costs)
    # F on r0 [0,1], activation [1,2], F+B on r1 [2,5], gradient [5,6], B on r0 [6,8]
    assert result.step_time == pytest.approx(8.0)
    starts = {(iv.rank, iv.action.kind): iv.start for iv in result.intervals}
    assert starts[(1, Kind.FORWARD)] == pytest.approx(2.0)
    assert starts[(0, Kind.BACKWARD)] == pytest.approx(6.0)
    assert Link(latency=1e-3, bandwidth=1e9).seconds(2e9) == pytest.approx(2.001)
    assert Link(latency=1e-3).seconds(0) == 0.0


def test_jitter_is_deterministic_and_spikes_at_the_given_rate():
    jitter = Jitter(0.2, 0.3, spike_prob=0.1, spike=1.2, seed=7)
    samples = [jitter.sample(m) for m in range(2000)]
    assert samples == [jitter.sample(m) for m in range(2000)]
    assert samples != [Jitter(0.2, 0.3, 0.1, 1.2, seed=8).sample(m) for m in range(2000)]
    spikes = sum(s == 1.2 for s in samples)
    assert 140 < spikes < 260
    assert all(0.2 <= s <= 0.3 for s in samples if s != 1.2)
    assert jitter.mean == pytest.approx(0.9 * 0.25 + 0.1 * 1.2)


def test_encoder_jitter_reaches_the_simulated_times():
    jitter = Jitter(0.2, 0.3, spike_prob=0.5, spike=1.5, seed=3)
    costs = CostTable({"vit": RegionCost(jitter=jitter), "llm": RegionCost(forward=1.0)})
    plan = compose([Region("vit", 2, Decoupled(ranks=1), trainable=False), Region("llm", 4, OneFOneB(stages=2))], 6)
    result = simulate(plan, costs)
    vit = [iv for iv in result.intervals if iv.action.region == "vit"]
    assert [iv.end - iv.start for iv in vit] == pytest.approx([jitter.sample(iv.action.microbatch) for iv in vit])
    nominal = costs.nominal()
    assert nominal.regions["vit"].jitter is None
    assert nominal.regions["vit"].forward == pytest.approx(jitter.mean)


def test_pack_costs_scale_microbatches_around_the_mean():
    scale = pack_scale({"llm": [1.0, 3.0]})
    assert (scale("llm", 0), scale("llm", 1), scale("llm", 2), scale("vit", 0)) == (0.5, 1.5, 0.5, 1.0)
    costs = CostTable({"llm": RegionCost(forward=2.0)}, microbatch_scale=scale)
    result = simulate(compose([Region("llm", 1, OneFOneB(stages=1))], 2), costs)
    forwards = [iv.end - iv.start for iv in result.intervals if iv.action.kind is Kind.FORWARD]
    assert forwards == pytest.approx([1.0, 3.0])


def test_decoupled_encoder_overlaps_the_backbone():
    costs = CostTable({"vit": RegionCost(forward=1.0), "llm": RegionCost(forward=2.0)})
    inside = simulate(compose([Region("vit", 1, OneFOneB(stages=1, layers=(3,)), trainable=False),
                               Region("llm", 2, OneFOneB(stages=1, layers=(3,)))], 8), costs)
    apart = simulate(compose([Region("vit", 1, Decoupled(ranks=1), trainable=False),
                              Region("llm", 2, OneFOneB(stages=1))], 8), costs)
    assert inside.step_time == pytest.approx(8 * (1 + 2 + 4))
    assert apart.step_time == pytest.approx(1 + 8 * 6)  # only the first encoder output is waited for


def test_collectives_of_a_trainable_transposed_region_cost_their_bytes():
    costs = CostTable(
        {"vit": RegionCost(forward=1.0, param_bytes=2e9), "llm": RegionCost(forward=2.0)},
        link=Link(bandwidth=1e9),
    )
    result = simulate(compose([Region("vit", 2, Transpose()), Region("llm", 4, OneFOneB(stages=2))], 4), costs)
    collectives = {(iv.rank, iv.action.kind): iv.end - iv.start for iv in result.intervals
                   if iv.action.kind in (Kind.PARAM_BROADCAST, Kind.GRAD_REDUCE)}
    assert collectives[(0, Kind.PARAM_BROADCAST)] == pytest.approx(2.0)  # 2 GB at 1 GB/s
    assert collectives[(1, Kind.GRAD_REDUCE)] == pytest.approx(2.0)  # ring: 2 (n-1)/n x 2 GB


def test_missing_cost_entry_is_named():
    from mindspeed_flow.schedule import ScheduleError

    with pytest.raises(ScheduleError, match="cost table has no entry for region 'llm'"):
        simulate(compose([Region("llm", 2, OneFOneB(stages=2))], 2), CostTable({}))


def test_gantt_draws_one_row_per_rank(tmp_path):
    pytest.importorskip("matplotlib")
    plan = compose([Region("vit", 2, Transpose(), trainable=False), Region("llm", 4, OneFOneB(stages=2))], 4)
    costs = CostTable({"vit": RegionCost(forward=0.5), "llm": RegionCost(forward=2.0)})
    result = simulate(plan, costs)
    path = draw(result, tmp_path / "charts" / "t.png", "transpose")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = result.summary().splitlines()
    assert lines[0].startswith("step ") and len(lines) == 1 + len(plan.programs)
    assert "r1 vit(transposed) + llm.s1" in lines[2]


def test_packing_cost_model_drives_microbatch_times():
    from mindspeed_flow.packing.cost_model import CostModel

    model = CostModel(linear=1e-4, quadratic=1e-8)
    packs = [[8192], [256] * 32, [4096, 4096], [1024] * 8]
    pack_costs = [model.cost(p) for p in packs]
    costs = CostTable({"llm": RegionCost(forward=1.0)}, microbatch_scale=pack_scale({"llm": pack_costs}))
    result = simulate(compose([Region("llm", 2, OneFOneB(stages=1))], len(packs)), costs)
    forwards = [iv.end - iv.start for iv in result.intervals if iv.action.kind is Kind.FORWARD]
    mean = sum(pack_costs) / len(pack_costs)
    assert forwards == pytest.approx([c / mean for c in pack_costs])
    assert forwards[0] > forwards[1]  # same tokens, one long segment: more attention


def test_max_in_flight_bounds_a_producers_activation_memory():
    costs = CostTable({"vit": RegionCost(forward=0.5, stored_bytes=1.0), "llm": RegionCost(forward=4.0)})

    def producer_peak(window):
        vit = Region("vit", 2, Decoupled(ranks=1, max_in_flight=window))
        plan = compose([vit, Region("llm", 4, OneFOneB(stages=2))], 8)
        return simulate(plan, costs).peak_live[0]

    assert producer_peak(None) == 8  # runs ahead through every microbatch
    assert producer_peak(3) == 3


def test_too_small_a_window_cannot_be_ordered():
    from mindspeed_flow.schedule import ScheduleError

    # with one producer rank, mb1's forward would wait for mb0's backward, which needs the
    # 1F1B stage 0 to have run mb1's forward first
    vit = Region("vit", 2, Decoupled(ranks=1, max_in_flight=1))
    with pytest.raises(ScheduleError, match="skeleton orders cannot be merged: rank 0 waits at F      vit.s0 mb1"):
        compose([vit, Region("llm", 4, OneFOneB(stages=2))], 4)
