"""What the trainer's frozen ViT relies on to run ahead without stalling its step
(``EmbeddingProducer.run_ahead``), in one process on the ``local`` pool: encoding the next
step stops at a full pool instead of waiting, keeps what had no room (nothing evicted),
and that step's ``forward`` puts it and encodes only the batches not encoded yet, so each
batch is encoded once and every sample reaches the consumer once."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from mindspeed_flow.flow import EmbeddingConsumer, EmbeddingProducer, EncoderCost, SampleMeta, StreamError, group_step
from mindspeed_flow.flow.transfers import take_ready
from mindspeed_flow.packing import CostModel
from mindspeed_flow.pool import open_pool
from mindspeed_flow.pool.local import drop

HIDDEN = 3
ENTRY = 64  # bytes each of these entries takes in a segment (<= 60 bytes, 64-byte aligned)
_names = itertools.count()
METAS = [SampleMeta(0, 0, 10, 2, (8,)), SampleMeta(1, 0, 12, 5, (20,)), SampleMeta(2, 0, 6, 0, ()),
         SampleMeta(3, 0, 9, 1, (4,)), SampleMeta(4, 0, 11, 3, (12,))]


def _grouping(step: int):
    return group_step([dataclasses.replace(m, step=step) for m in METAS], capacity=32,
                      llm_cost=CostModel(linear=1.0), encoder_cost=EncoderCost(linear=1.0), encoder_budget=16.0,
                      microbatches=2)


def _rows(meta: SampleMeta) -> torch.Tensor:
    return torch.full((meta.image_tokens, HIDDEN), float(100 * meta.step + meta.sample_id))


@pytest.fixture
def pools():
    name = f"flow-ahead-{next(_names)}"
    producer_pool = open_pool("local", 4 * ENTRY, name=name, owner="encoder", timeout_s=5)
    consumer_pool = open_pool("local", 1 << 12, name=name, owner="backbone", timeout_s=5)
    yield producer_pool, consumer_pool
    producer_pool.close()
    consumer_pool.close()
    drop(name)


def test_running_ahead_stops_at_a_full_pool_and_the_next_forward_finishes_it(pools):
    producer_pool, consumer_pool = pools
    step0, step1 = _grouping(0), _grouping(1)
    producer = EmbeddingProducer(producer_pool, lambda metas: torch.cat([_rows(m) for m in metas]), replica=0,
                                 trainable=False, timeout_s=5)
    consumer = EmbeddingConsumer(consumer_pool, trainable=False, timeout_s=5)
    producer.forward(step0)
    for m in range(len(step0.microbatches)):
        consumer.take(step0, m)
    producer_pool.put("filler", torch.zeros(2 * ENTRY // 4))  # half the segment stays held
    assert producer.run_ahead(step1) >= 1  # returned with the pool full (it never waits)
    ahead = producer.ahead
    step1_keys = {str(m.key("act")) for m in step1.samples if m.patches}
    assert set(ahead) <= step1_keys and len(ahead) > 2  # more encoded than the pool holds: the rest is held
    taken = take_ready(consumer_pool, ["filler", *ahead])  # room again: the backbone's next step takes them
    del taken["filler"]
    assert 0 < len(taken) < len(ahead)  # some were put, the rest held (not in the pool: nothing evicted)
    producer.forward(step1)  # puts the held entries, encodes only the batches not encoded yet
    rest = take_ready(consumer_pool, step1_keys - set(taken))
    assert set(taken) | set(rest) == step1_keys and not set(taken) & set(rest)  # every sample of step 1 once
    assert all(float(t[0, 0]) == 100 + int(k.rsplit("/", 1)[1]) for k, (_, t) in {**taken, **rest}.items())
    forwards = producer.stats.forwards
    assert sorted(forwards) == sorted(set(forwards))  # each batch encoded once
    assert {b for s, b in forwards if s == 1} == set(range(len(step1.batches)))


def test_a_trainable_encoder_does_not_run_ahead(pools):
    producer = EmbeddingProducer(pools[0], lambda metas: torch.zeros(1, HIDDEN), replica=0, trainable=True)
    with pytest.raises(StreamError, match="cannot run ahead into step 1"):
        producer.run_ahead(_grouping(1))
