"""A frozen producer kept for a whole job (MindSpeed-MM's encoder rank under the flow): what it
ran ahead into can be given up (:meth:`EmbeddingProducer.discard`: the step's entries leave the
pool, a later step of that number is encoded whole), and its bookkeeping stays bounded as the
steps go (taken keys forgotten, records of finished steps dropped).  Real ``local`` pool, one
process: the producer puts, the test takes as a backbone would."""

from __future__ import annotations

import os

import torch

from mindspeed_flow.flow import EmbeddingProducer, EncoderCost, SampleMeta, group_step
from mindspeed_flow.flow.meta import SampleKey
from mindspeed_flow.packing import CostModel
from mindspeed_flow.pool import open_pool

HIDDEN = 4


def step_samples(step: int) -> list[SampleMeta]:
    """Three samples with images (4, 8 and 4 patches; one image token per 4 patches)."""
    return [SampleMeta(i, step, 16, p // 4, (p,)) for i, p in enumerate((4, 8, 4))]


def grouping(step: int):
    return group_step(step_samples(step), capacity=64, microbatches=3, llm_cost=CostModel(), encoder_cost=EncoderCost(linear=1.0),
                      encoder_budget=8.0)


def encode(calls: list):
    def run(metas):
        calls.append((metas[0].step, tuple(m.sample_id for m in metas)))
        return torch.full((sum(m.image_tokens for m in metas), HIDDEN), float(metas[0].step))
    return run


def take_step(pool, g) -> None:
    """The backbone's side: take (get + release) every entry of the step."""
    for meta in g.samples:
        key = str(meta.key("act"))
        pool.get(key, timeout=1.0)
        pool.release(key)


def open_local(tag: str):
    return open_pool("local", capacity_bytes=1 << 16, name=f"discard{tag}{os.getpid()}", owner="p0")


def test_discard_releases_what_ran_ahead_and_the_step_is_encoded_again():
    pool, calls = open_local("a"), []
    producer = EmbeddingProducer(pool, encode(calls), replica=0, trainable=False, timeout_s=2.0)
    producer.forward(grouping(0))
    assert producer.run_ahead(grouping(1)) == len(grouping(1).batches)
    ahead = [str(m.key("act")) for m in grouping(1).samples]
    assert all(pool.ready(k) for k in ahead)
    assert producer.discard(1) == len(ahead)
    take_step(pool, grouping(0))
    assert not any(pool.ready(k) for k in ahead) and producer.ahead == []
    encoded_before = len(calls)
    producer.forward(grouping(1))  # step 1 again (an evaluation took its number): every batch encoded anew
    assert len(calls) - encoded_before == len(grouping(1).batches)
    assert all(pool.ready(k) for k in ahead)
    pool.close()


def test_discard_drops_entries_held_for_lack_of_room():
    pool = open_pool("local", capacity_bytes=3 * HIDDEN * 4, name=f"discardheld{os.getpid()}", owner="p0")
    producer = EmbeddingProducer(pool, encode([]), replica=0, trainable=False, timeout_s=2.0)
    producer.run_ahead(grouping(1))  # 4 rows of embeddings, room for 3: what does not fit is held
    ahead = [str(m.key("act")) for m in grouping(1).samples]
    put_now, held = [k for k in ahead if pool.ready(k)], len(producer._held)
    assert held, "the pool had room for the whole step ahead: the test needs some entries held"
    assert producer.discard(1) == len(put_now) + held
    assert producer.ahead == [] and not any(pool.ready(k) for k in ahead)
    pool.close()


def test_a_producer_kept_across_steps_keeps_bounded_records():
    pool, calls = open_local("b"), []
    producer = EmbeddingProducer(pool, encode(calls), replica=0, trainable=False, timeout_s=2.0)
    for step in range(20):
        g = grouping(step)
        producer.forward(g)
        take_step(pool, g)
        assert producer.stats.step_counts(step) == (len(g.batches), 0)
        producer.stats.forget_through(step)
    producer.forward(grouping(20))
    assert len(producer._in_flight) == len(grouping(20).samples)  # the 20 steps' taken keys forgotten
    assert {SampleKey.parse(k).step for k in producer._in_flight} == {20}
    assert {s for s, _ in producer.stats.forwards} == {20}
    pool.close()
