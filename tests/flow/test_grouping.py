"""The flow's grouping from sample metadata: the backbone's microbatches and the encoder's
batches differ, hold every sample once, and balance by their own costs; sample metadata,
pool keys and the encoder's cost fit."""

from __future__ import annotations

import dataclasses
import random
import re

import pytest

from mindspeed_flow.flow import (
    EncoderCost,
    GroupingError,
    SampleError,
    SampleKey,
    SampleMeta,
    group_step,
)
from mindspeed_flow.packing import CostModel, pack

LLM = CostModel(linear=1e-4, quadratic=2e-8, constant=1e-3)
ENCODER = EncoderCost(quadratic=4e-8, linear=1e-4, per_image=2e-3)


def step_samples(n=32, step=3, seed=0):
    """Samples with heavy-tailed image sizes (a few huge images, many small), some text-only."""
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        patches = tuple(min(4096, int(16 * rng.paretovariate(1.2))) for _ in range(rng.choice([0, 1, 1, 2])))
        image_tokens = sum(p // 4 for p in patches)
        samples.append(SampleMeta(100 + i, step, image_tokens + rng.randint(32, 600), image_tokens, patches))
    return samples


def grouped(samples=None, **overrides):
    kwargs = dict(capacity=4096, llm_cost=LLM, encoder_cost=ENCODER, encoder_budget=0.05,
                  encoder_replicas=2, dp=1, pp=2)
    kwargs.update(overrides)
    return group_step(step_samples() if samples is None else samples, **kwargs)


def test_encoder_batches_and_llm_microbatches_are_different_groupings():
    samples = step_samples()
    g = grouped(samples)
    assert len(g.batches) != len(g.microbatches)
    assert sorted(len(b) for b in g.batches) != sorted(len(m) for m in g.microbatches)
    with_images = {s.sample_id for s in samples if s.patches}
    llm_sets = {frozenset(s for s in m if s in with_images) for m in g.microbatches} - {frozenset()}
    assert {frozenset(b) for b in g.batches} != llm_sets


def test_every_sample_is_grouped_exactly_once_on_each_side():
    samples = step_samples()
    g = grouped(samples)
    g.check([s.sample_id for s in samples])
    in_microbatches = [s for m in g.microbatches for s in m]
    assert sorted(in_microbatches) == sorted(s.sample_id for s in samples)
    in_batches = [s for b in g.batches for s in b]
    assert sorted(in_batches) == sorted(s.sample_id for s in samples if s.patches)


def test_encoder_follows_the_backbones_need_order_within_its_budget():
    g = grouped(dp=2, pp=2, microbatches=8)
    needed = [s for m in g.microbatches for s in m if g.by_id[s].patches]
    assert [s for b in g.batches for s in b] == needed
    for batch in g.batches:
        assert len(batch) == 1 or ENCODER.cost(g.metas(batch)) <= 0.05
    # batches go to the replica free first: the loads differ by at most one batch
    loads = [sum(ENCODER.cost(g.metas(g.batches[b])) for b in g.replica_batches(r)) for r in range(2)]
    assert abs(loads[0] - loads[1]) <= max(ENCODER.cost(g.metas(b)) for b in g.batches)
    # the first microbatch of every replica comes before any second one
    assert [g.microbatch_replica[m] for m in range(4)] == [0, 1, 0, 1]


def test_a_late_heavy_image_is_dealt_first_when_that_unloads_the_busiest_encoder_replica():
    # one microbatch: the need order is the fill's (most LLM tokens first), so the image of
    # 192 patches comes last; in need order it would go to the replica free first, already
    # holding 64 patches (256 vs 128); dealt first it is alone on its replica (192 vs 192)
    encoder = EncoderCost(linear=1e-3)
    samples = [SampleMeta(i, 0, tokens, patches // 4, (patches,))
               for i, (tokens, patches) in enumerate([(400, 64), (300, 64), (200, 64), (100, 192)])]
    g = group_step(samples, capacity=2048, llm_cost=LLM, encoder_cost=encoder, encoder_budget=1e-6,
                   encoder_replicas=2, microbatches=1)
    assert g.batches == ((0,), (1,), (2,), (3,))  # one sample per batch, in need order
    loads = sorted(sum(encoder.cost(g.metas(g.batches[b])) for b in g.replica_batches(r)) for r in range(2))
    assert loads == pytest.approx([0.192, 0.192])
    assert g.replica_batches(g.batch_replica[3]) == [3]


def test_encoder_replicas_are_never_busier_than_dealt_in_need_order():
    for seed in range(20):
        g = grouped(step_samples(seed=seed), dp=2, pp=2, microbatches=8, encoder_replicas=3)
        costs = [ENCODER.cost(g.metas(b)) for b in g.batches]
        loads = [sum(costs[b] for b in g.replica_batches(r)) for r in range(3)]
        free_first = [0.0] * 3  # each batch, in need order, to the replica with the least so far
        for c in costs:
            free_first[free_first.index(min(free_first))] += c
        assert max(loads) <= max(free_first) + 1e-12
        assert max(loads) - min(loads) <= max(costs) + 1e-12


def test_check_refuses_a_lost_sample_naming_it():
    samples = step_samples()
    g = grouped(samples)
    lost = g.microbatches[0][0]
    broken = dataclasses.replace(g, microbatches=(g.microbatches[0][1:],) + g.microbatches[1:])
    with pytest.raises(GroupingError, match=rf"sample {lost} is in no LLM microbatch \(lost\)"):
        broken.check([s.sample_id for s in samples])
    lost = g.batches[-1][-1]
    broken = dataclasses.replace(g, batches=g.batches[:-1] + (g.batches[-1][:-1],))
    with pytest.raises(GroupingError, match=rf"sample {lost} is in no encoder batch \(lost\)"):
        broken.check([s.sample_id for s in samples])


def test_check_refuses_a_repeated_sample_naming_it():
    samples = step_samples()
    g = grouped(samples)
    twice = g.microbatches[0][0]
    broken = dataclasses.replace(g, microbatches=g.microbatches + ((twice,),))
    with pytest.raises(GroupingError, match=rf"sample {twice} is in LLM microbatches \[0, {len(g.microbatches)}\]"):
        broken.check([s.sample_id for s in samples])
    with pytest.raises(GroupingError, match=rf"sample {samples[0].sample_id} is listed twice"):
        g.check([s.sample_id for s in samples] + [samples[0].sample_id])
    with pytest.raises(GroupingError, match=r"sample \d+ in LLM microbatch \d+ is not one of the step's samples"):
        g.check([s.sample_id for s in samples[1:]])


def test_zigzag_dispatch_balances_replicas_and_alternates_heavy_and_light():
    g = grouped(dp=2, pp=2, microbatches=8)
    cost = [LLM.cost([s.llm_tokens for s in g.metas(m)]) for m in g.microbatches]
    loads = []
    for d in range(2):
        mine = [cost[m] for m in g.replica_microbatches(d)]
        assert len(mine) == 4
        # heaviest, lightest, second heaviest, second lightest (dispatch's pipeline order)
        ranked = sorted(mine, reverse=True)
        assert mine == [ranked[0], ranked[-1], ranked[1], ranked[-2]]
        loads.append(sum(mine))
    assert abs(loads[0] - loads[1]) <= max(cost) - min(cost)


def test_microbatch_count_is_best_fit_packings_or_the_jobs():
    samples = step_samples()
    packed = len(pack([s.llm_tokens for s in samples], 4096))
    assert len(grouped(samples, dp=1).microbatches) == packed
    assert len(grouped(samples, dp=2).microbatches) == packed + packed % 2
    many = grouped(samples, microbatches=12)
    assert len(many.microbatches) == 12 and all(many.microbatches)
    assert all(sum(s.llm_tokens for s in many.metas(m)) <= 4096 for m in many.microbatches)
    # filled by cost, heaviest sample first into the cheapest microbatch: the costs stay close
    cost = [LLM.cost([s.llm_tokens for s in many.metas(m)]) for m in many.microbatches]
    assert min(cost) > 0.8 * max(cost)


def test_group_step_refuses_what_it_cannot_group():
    samples = step_samples()
    with pytest.raises(GroupingError, match=r"sample \d+ has \d+ LLM tokens, more than a microbatch's capacity of 64"):
        grouped(samples, capacity=64)
    with pytest.raises(GroupingError, match="microbatches=3 is not a positive multiple of dp=2"):
        grouped(samples, dp=2, microbatches=3)
    with pytest.raises(GroupingError, match="40 microbatches need at least 40 samples"):
        grouped(samples, microbatches=40)
    with pytest.raises(GroupingError, match="fits none of 2 microbatches"):
        grouped(samples, microbatches=2)
    other = dataclasses.replace(samples[5], step=4)
    with pytest.raises(GroupingError, match=f"sample {other.sample_id} belongs to step 4, not step 3"):
        grouped(samples[:5] + [other])


def test_encoder_cost_fit_recovers_known_coefficients():
    truth = EncoderCost(quadratic=3e-8, linear=2e-5, per_image=1.5e-3)
    rng = random.Random(1)
    observations = []
    for _ in range(20):
        batch = [SampleMeta(i, 0, 8, 0, tuple(rng.randint(16, 2048) for _ in range(rng.randint(1, 3))))
                 for i in range(rng.randint(1, 6))]
        observations.append((batch, truth.cost(batch)))
    fitted = EncoderCost.fit(observations)
    for name in ("quadratic", "linear", "per_image"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    with pytest.raises(SampleError, match="need at least 3 observations, got 2"):
        EncoderCost.fit(observations[:2])


def test_pool_keys_and_metadata_round_trip():
    meta = SampleMeta(17, 3, 500, 64, (256, 16))
    assert str(meta.key("act")) == "flow/step3/act/17"
    assert SampleKey.parse("flow/step3/grad/17") == meta.key("grad")
    assert SampleMeta.from_pool_meta(meta.to_pool_meta()) == meta
    for bad in ("flow/step3/act/x", "step3/act/17", "flow/step3/weight/17"):
        with pytest.raises(SampleError, match=re.escape("expected `flow/step<n>/act|grad/<sample id>`")):
            SampleKey.parse(bad)
    with pytest.raises(SampleError, match="sample 4: 90 image tokens in a sequence of 80 tokens"):
        SampleMeta(4, 0, 80, 90)
    with pytest.raises(SampleError, match="every image needs >= 1 patch"):
        SampleMeta(4, 0, 80, 10, (0,))


def test_microbatches_balance_the_llms_cost_where_token_counts_are_equal_work():
    """One long sample and many short ones: best-fit packing by tokens makes two packs of
    2000 and 1000 tokens, and with attention's ``sum l^2`` term the long sample's pack costs
    nearly three times the other.  The grouping fills its microbatches by the cost model
    instead, so the two data-parallel replicas' costs end within one short sample's cost."""
    quadratic = CostModel(linear=1e-4, quadratic=1e-7)
    samples = [SampleMeta(0, 0, 1000)] + [SampleMeta(1 + i, 0, 100) for i in range(20)]
    lengths = [s.llm_tokens for s in samples]

    def replica_costs(groups):
        return sorted(quadratic.cost([lengths[i] for i in g]) for g in groups)

    by_tokens = replica_costs(pack(lengths, 2048))  # the token count's grouping, one pack per replica
    assert len(by_tokens) == 2 and by_tokens[1] > 2 * by_tokens[0]
    g = grouped(samples, capacity=2048, llm_cost=quadratic, dp=2, pp=1)
    assert len(g.microbatches) == 2 and g.microbatch_replica == (0, 1)
    by_cost = replica_costs(g.microbatches)
    one_short = quadratic.cost([100])
    assert by_cost[1] - by_cost[0] <= one_short
    assert by_cost[1] < 0.8 * by_tokens[1]
    g.check([s.sample_id for s in samples])
