"""DP sharding: every rank reads a disjoint part of each epoch, together all of it."""

from __future__ import annotations

import numpy as np
import pytest

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.sharding import rank_indices

from data_corpus import SAMPLES, demo_corpus


@pytest.mark.parametrize("n", [0, 1, 7, 1000])
@pytest.mark.parametrize("dp_size", [1, 2, 3, 8])
def test_rank_indices_disjoint_and_complete(n, dp_size):
    for epoch in range(3):
        parts = [rank_indices(n, 5, epoch, r, dp_size) for r in range(dp_size)]
        joined = np.concatenate(parts)
        assert sorted(joined.tolist()) == list(range(n))
        assert max(map(len, parts)) - min(map(len, parts)) <= (1 if n else 0)


def test_epochs_shuffle_differently_and_seeds_matter():
    a, b = rank_indices(1000, 5, 0, 0, 1), rank_indices(1000, 5, 1, 0, 1)
    assert not np.array_equal(a, b)
    assert np.array_equal(a, rank_indices(1000, 5, 0, 0, 1))
    assert not np.array_equal(a, rank_indices(1000, 6, 0, 0, 1))


def test_bad_rank_is_refused(tmp_path):
    with pytest.raises(ValueError, match="dp_rank=3, dp_size=3"):
        rank_indices(10, 0, 0, 3, 3)
    with pytest.raises(ValueError, match="dp_rank=2, dp_size=2"):  # by the constructor, before any worker starts
        FlowDataLoader(tmp_path / "not-read", None, dp_rank=2, dp_size=2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo_corpus(tmp_path_factory)


@pytest.mark.parametrize("dp_size", [1, 2, 3, 8])
def test_loaders_of_all_ranks_yield_every_sample_once(corpus, dp_size):
    per_rank = []
    for rank in range(dp_size):
        loader = FlowDataLoader(corpus, None, capacity=1024, dp_rank=rank, dp_size=dp_size, num_workers=0,
                                window=4, max_pixels=112 * 112)
        per_rank.append([i for batch in loader for i in batch["sample_ids"]])
        assert loader.stats.samples_seen in (SAMPLES // dp_size, -(-SAMPLES // dp_size))
    ids = [i for part in per_rank for i in part]
    assert len(ids) == len(set(ids)) == SAMPLES


def test_a_rank_parses_only_its_own_records(corpus, tmp_path):
    """Records of the other ranks are made unreadable: rank 1 of 3 never touches them."""
    records = (corpus / "part-0000.jsonl").read_text().splitlines()
    mine = set(rank_indices(len(records), 9, 0, 1, 3).tolist())
    (tmp_path / "shard.jsonl").write_text("".join((line if i in mine else "{not json") + "\n"
                                                  for i, line in enumerate(records)))
    (tmp_path / "flow_demo_tokenizer.json").write_bytes((corpus / "flow_demo_tokenizer.json").read_bytes())
    loader = FlowDataLoader(tmp_path, None, capacity=1024, dp_rank=1, dp_size=3, num_workers=0, seed=9,
                            bad_input="fail", image_root=corpus, max_pixels=112 * 112)
    ids = sorted(i for batch in loader for i in batch["sample_ids"])
    assert ids == sorted(f"shard.jsonl:{i + 1}" for i in mine)
