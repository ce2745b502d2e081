"""One decoding rank per DP replica; its TP/PP peers receive the batches by broadcast.

Four gloo processes: DP = 2 replicas of two ranks each ({0, 1} and {2, 3}).  The peers are
given a source path that does not exist, so any batch they yield came over the wire.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from megatron_cpu_harness import launch
from mindspeed_flow.data.batch import TENSOR_KEYS

from data_corpus import demo_corpus

SAMPLES = 40


def _digest(batch: dict) -> dict:
    return {"sample_ids": batch["sample_ids"],
            **{k: (str(batch[k].dtype), tuple(batch[k].shape), hashlib.sha256(batch[k].numpy().tobytes()).hexdigest())
               for k in TENSOR_KEYS}}


def _replica_worker(rank: int, world_size: int, corpus: str) -> dict:
    import torch.distributed as dist

    from mindspeed_flow.data import FlowDataLoader

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = groups[rank // 2]
    source = corpus if rank % 2 == 0 else corpus + "/does-not-exist"
    loader = FlowDataLoader(source, None, capacity=1024, dp_rank=rank // 2, dp_size=2, num_workers=0, window=4,
                            group=group, max_pixels=112 * 112)
    epochs = [[_digest(b) for b in loader] for _ in range(2)]
    return {"decoding": loader.decoding, "epochs": epochs, "packs": loader.stats.packs}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo_corpus(tmp_path_factory, samples=SAMPLES)


def test_peers_receive_exactly_the_source_ranks_batches(corpus):
    results = launch(_replica_worker, 4, str(corpus), timeout_s=240)
    assert [r["decoding"] for r in results] == [True, False, True, False]
    for src, peer in ((0, 1), (2, 3)):
        assert results[src]["epochs"] == results[peer]["epochs"]
        assert results[src]["packs"] > 0 and results[peer]["packs"] == 0  # the peer decoded nothing
    for epoch in range(2):
        ids = [i for r in (results[0], results[2]) for b in r["epochs"][epoch] for i in b["sample_ids"]]
        assert len(ids) == len(set(ids)) == SAMPLES  # the two replicas read disjoint shards
