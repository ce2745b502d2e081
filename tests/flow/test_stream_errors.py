"""The flow runtime's pieces in one process, on the ``local`` pool (threads are its
participants): a producer thread and a consumer round trip with a linear "encoder" whose
gradient is known; the placement matches compose_flow's plan; wrong entries, wrong encoder
outputs, steps ending early and puts that can never fit are refused naming what is wrong.
The multi-process flow: ``test_stream.py``."""

from __future__ import annotations

import itertools
import re
import threading

import pytest
import torch

from mindspeed_flow.flow import (EmbeddingConsumer, EmbeddingProducer, EncoderCost, FlowRanks, SampleMeta,
                                 StreamError, compose_flow, group_step)
from mindspeed_flow.flow.transfers import put_waiting
from mindspeed_flow.packing import CostModel
from mindspeed_flow.pool import PoolFull, open_pool
from mindspeed_flow.pool.local import drop

HIDDEN = 3
_names = itertools.count()


def _grouping(encoder_replicas: int = 1):
    metas = [SampleMeta(0, 0, 10, 2, (8,)), SampleMeta(1, 0, 12, 5, (20,)), SampleMeta(2, 0, 6, 0, ()),
             SampleMeta(3, 0, 9, 1, (4,)), SampleMeta(4, 0, 11, 3, (12,))]
    return group_step(metas, capacity=32, llm_cost=CostModel(linear=1.0), encoder_cost=EncoderCost(linear=1.0),
                      encoder_budget=16.0, encoder_replicas=encoder_replicas, microbatches=2)


@pytest.fixture
def pool_name():
    name = f"stream-test-{next(_names)}"
    yield name
    drop(name)


def _features(meta: SampleMeta) -> torch.Tensor:
    return torch.arange(meta.image_tokens * HIDDEN, dtype=torch.float32).reshape(-1, HIDDEN) + meta.sample_id


def _producer_thread(name: str, weight: torch.nn.Parameter, trainable: bool, errors: list) -> threading.Thread:
    def run():
        try:
            with open_pool("local", 1 << 16, name=name, owner="encoder", timeout_s=20) as pool:
                def encode(metas):
                    return torch.cat([_features(m) for m in metas]) * weight

                EmbeddingProducer(pool, encode, replica=0, trainable=trainable).run([_grouping()])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    return threading.Thread(target=run)


def test_round_trip_gives_the_encoders_gradient(pool_name):
    """Consumer takes each microbatch (samples in packed order), a loss weights every row,
    the gradient goes back per sample and the producer's backward gives the encoder weight
    exactly the gradient of the same loss computed in one piece."""
    grouping = _grouping()
    weight = torch.nn.Parameter(torch.tensor([1.0, 2.0, -1.0]))
    errors: list = []
    thread = _producer_thread(pool_name, weight, True, errors)
    thread.start()
    with open_pool("local", 1 << 16, name=pool_name, owner="backbone", timeout_s=20) as pool:
        consumer = EmbeddingConsumer(pool, trainable=True, timeout_s=20)
        for m, ids in enumerate(grouping.microbatches):
            embeddings = consumer.take(grouping, m)
            expected = torch.cat([_features(grouping.by_id[s]) for s in ids if grouping.by_id[s].patches]) * weight
            torch.testing.assert_close(embeddings, expected.detach(), rtol=0, atol=0)
            (embeddings * (m + 1)).sum().backward()
        consumer.finish(grouping, 0)
        thread.join(timeout=30)
    assert not errors and not thread.is_alive()
    rows = [(_features(grouping.by_id[s]), m + 1) for m, ids in enumerate(grouping.microbatches) for s in ids]
    torch.testing.assert_close(weight.grad, sum(f.sum(0) * k for f, k in rows), rtol=1e-6, atol=0)
    assert sorted(s for _, s in consumer.stats.grads_put) == [0, 1, 3, 4]  # sample 2 has no image


def test_placement_is_compose_flows():
    grouping = group_step([SampleMeta(i, 0, 8, 2, (8,)) for i in range(8)], capacity=16, llm_cost=CostModel(1.0),
                          encoder_cost=EncoderCost(linear=1.0), encoder_budget=16.0, encoder_replicas=2, dp=2, pp=2,
                          microbatches=4)
    ranks = FlowRanks.of(grouping)
    roles = compose_flow(grouping).roles
    assert ranks.world_size == len(roles) == 6
    for rank in range(ranks.world_size):
        region, replica, stage = ranks.role(rank)
        assert roles[rank] == (f"vit(flow) replica {replica}" if region == "vit" else f"llm.s{stage} dp{replica}")
    assert ranks.pipeline(1) == [4, 5] and ranks.stage_peers(0) == [2, 4]


def test_consumer_refuses_an_entry_with_another_samples_metadata(pool_name):
    grouping = _grouping()
    with open_pool("local", 1 << 16, name=pool_name, owner="backbone", timeout_s=5) as pool:
        meta = grouping.by_id[grouping.microbatches[0][0]]
        wrong = SampleMeta(meta.sample_id, meta.step, meta.llm_tokens + 1, meta.image_tokens, meta.patches)
        for s in grouping.microbatches[0]:
            m = grouping.by_id[s]
            if m.patches:
                pool.put(str(m.key("act")), _features(m), (wrong if s == meta.sample_id else m).to_pool_meta())
        with pytest.raises(StreamError, match=f"flow/step0/act/{meta.sample_id} carries the metadata"):
            EmbeddingConsumer(pool, trainable=False).take(grouping, 0)


def test_producer_refuses_an_encoder_output_of_the_wrong_rows(pool_name):
    grouping = _grouping()
    with open_pool("local", 1 << 16, name=pool_name, owner="encoder", timeout_s=5) as pool:
        producer = EmbeddingProducer(pool, lambda metas: torch.zeros(1, HIDDEN), replica=0, trainable=False)
        with pytest.raises(StreamError, match=r"step 0 batch 0: the encoder returned shape \(1, 3\)"):
            producer.forward(grouping)


def test_a_step_that_ends_early_is_refused_naming_the_samples(pool_name):
    grouping = _grouping()
    weight = torch.nn.Parameter(torch.ones(HIDDEN))
    errors: list = []
    thread = _producer_thread(pool_name, weight, False, errors)
    thread.start()
    with open_pool("local", 1 << 16, name=pool_name, owner="backbone", timeout_s=20) as pool:
        consumer = EmbeddingConsumer(pool, trainable=True)
        consumer.take(grouping, 0)  # never backward: no gradient goes back
        pooled = sorted(s for ids in grouping.microbatches for s in ids if grouping.by_id[s].patches)
        with pytest.raises(StreamError, match=r"without taking the embeddings of samples \[") as missing:
            consumer.finish(grouping, 0)
        assert all(str(s) in str(missing.value) for s in grouping.microbatches[1] if grouping.by_id[s].patches)
        consumer.take(grouping, 1)
        with pytest.raises(StreamError, match=re.escape(f"putting the embedding gradients of samples {pooled}")):
            consumer.finish(grouping, 0)
        thread.join(timeout=30)
    assert not errors


def test_put_larger_than_the_capacity_is_refused_at_once_and_a_full_pool_waits(pool_name):
    with open_pool("local", 256, name=pool_name, owner="encoder", timeout_s=5) as pool:
        with pytest.raises(PoolFull, match="exceed the producer's whole capacity of 256 bytes"):
            put_waiting(pool, "big", torch.zeros(65, dtype=torch.float32), {}, timeout_s=5)
        pool.put("first", torch.zeros(40), {})
        released = []

        def while_full():  # a consumer takes the first entry while the put waits
            if not released:
                pool.release("first")
                released.append(True)

        waits = put_waiting(pool, "second", torch.zeros(40), {}, timeout_s=5, while_full=while_full)
        assert waits >= 1 and released and pool.ready("second")
        with pytest.raises(PoolFull, match=r"waited 0.1 s in all"):
            put_waiting(pool, "third", torch.zeros(40), {}, timeout_s=0.1)
