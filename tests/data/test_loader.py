"""FlowDataLoader on the demo corpus: the batch contract, images, one complete epoch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.demo import make_demo_corpus
from mindspeed_flow.data.images import MEAN, PATCH, QWEN2_VL, STD, normalize, patchify, resized_size
from mindspeed_flow.data.mrope import mrope_position_ids
from mindspeed_flow.data.source import Corpus
from mindspeed_flow.data.tokenizer import load_tokenizer

from data_corpus import SAMPLES, demo_corpus

CAPACITY = 1024


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo_corpus(tmp_path_factory)


@pytest.fixture(scope="module")
def epoch(corpus):
    loader = FlowDataLoader(corpus, None, capacity=CAPACITY, num_workers=2, window=8, seed=3, max_pixels=224 * 224)
    return loader, list(loader)


def test_one_epoch_holds_every_sample_once_in_packs_within_capacity(epoch):
    loader, batches = epoch
    ids = [i for b in batches for i in b["sample_ids"]]
    assert len(ids) == len(set(ids)) == SAMPLES
    assert all(b["input_ids"].shape[1] <= CAPACITY for b in batches)
    assert loader.stats.samples_seen == loader.stats.samples_packed == SAMPLES
    assert loader.stats.packs == len(batches) and loader.stats.epochs == 1
    assert sum(loader.stats.bad.values()) == 0
    # packing did its job: far fewer packs than samples, mostly full
    assert len(batches) < SAMPLES / 4 and loader.stats.fill > 0.9


def test_batch_contract(epoch, corpus):
    _, batches = epoch
    tok = load_tokenizer(None, corpus)
    image_id, start_id = tok.special.image_pad, tok.special.vision_start
    for b in batches:
        T = b["input_ids"].shape[1]
        assert b["input_ids"].shape == b["labels"].shape == b["attention_mask"].shape == (1, T)
        cu = b["cu_seqlens"]
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == T and len(cu) == len(b["sample_ids"]) + 1
        assert bool((cu[1:] > cu[:-1]).all())
        assert b["position_ids"].shape == (3, 1, T) and b["position_ids"].dtype == torch.int64
        assert b["pixel_values"].shape[1] == 1176 and b["pixel_values"].dtype == torch.float32
        grid = b["image_grid_thw"]
        assert grid.shape[1] == 3 and int(grid.prod(dim=1).sum()) == b["pixel_values"].shape[0]
        # every image placeholder expanded to (h*w)/4 tokens, images in sample order
        assert int((b["input_ids"] == image_id).sum()) == sum(QWEN2_VL.tokens(tuple(g)) for g in grid.tolist())
        assert bool((b["labels"][0, cu[:-1].long()] == -100).all())
        image = 0
        for s, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            ids = b["input_ids"][0, lo:hi]
            n_images = int((ids == start_id).sum())
            own = grid[image:image + n_images]
            image += n_images
            expected = mrope_position_ids(ids, own if n_images else None, image_token_id=image_id,
                                          vision_start_token_id=start_id)
            assert torch.equal(b["position_ids"][:, 0, lo:hi], expected)
            assert b["position_ids"][:, 0, lo].tolist() == [0, 0, 0]  # restarts per sample
            # image tokens are never trained
            assert bool((b["labels"][0, lo:hi][ids == image_id] == -100).all())
        assert image == len(grid)


def test_labels_train_only_assistant_turns(epoch, corpus):
    _, batches = epoch
    tok = load_tokenizer(None, corpus)
    b = batches[0]
    lo, hi = b["cu_seqlens"][:2].tolist()
    ids, labels = b["input_ids"][0, lo:hi], b["labels"][0, lo:hi]
    trained = ids[labels != -100].tolist()
    text = tok.backend.decode(trained, skip_special_tokens=True)
    record = Corpus.open(corpus).read(_index_of(corpus, b["sample_ids"][0]))
    answers = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    assert text.replace("\n", "") == "".join(answers)


def _index_of(corpus, sample_id: str) -> int:
    c = Corpus.open(corpus)
    return next(i for i in range(len(c)) if c.place(i) == sample_id)


@pytest.mark.parametrize("h,w", [(40, 448), (448, 40), (30, 30), (1000, 700), (224, 224), (57, 113)])
def test_resized_size_multiples_of_28_within_bounds(h, w):
    rh, rw = resized_size(h, w, min_pixels=3136, max_pixels=262144)
    assert rh % 28 == 0 and rw % 28 == 0
    assert 3136 <= rh * rw <= 262144
    assert abs(np.log((rh / rw) / (h / w))) < 0.5


def test_patchify_rows_are_merge_groups_of_14x14_patches():
    rng = np.random.default_rng(0)
    image = rng.standard_normal((56, 84, 3)).astype(np.float32)
    rows, grid = patchify(image)
    assert grid == (1, 4, 6) and rows.shape == (24, 1176)
    # row r: merge block (bh, bw) in raster order, then (mh, mw) inside the 2x2 block
    for r in range(24):
        block, inner = divmod(r, 4)
        bh, bw = divmod(block, 3)
        mh, mw = divmod(inner, 2)
        y, x = (2 * bh + mh) * PATCH, (2 * bw + mw) * PATCH
        patch = image[y:y + PATCH, x:x + PATCH].transpose(2, 0, 1)  # [C, P, P]
        expected = np.stack([patch, patch], axis=1)  # [C, T=2, P, P]
        assert np.array_equal(rows[r], expected.reshape(-1))


def test_normalize_is_clip_mean_std_per_channel_of_each_row():
    rows = torch.randint(0, 256, (5, 1176), dtype=torch.uint8)
    out = normalize(rows)
    assert out.dtype == torch.float32 and out.shape == (5, 1176)
    channels = rows.numpy().reshape(5, 3, 2 * PATCH * PATCH).astype(np.float64) / 255.0  # row = [C, T, P, P]
    expected = (channels - MEAN[None, :, None]) / STD[None, :, None]
    assert np.allclose(out.numpy().reshape(5, 3, -1), expected, atol=1e-5)


def test_demo_corpus_is_byte_identical_for_the_same_seed(tmp_path):
    """make_demo_data.py's promise: the same seed writes the same records, images and tokenizer."""
    def files(root):
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    first, again, other = (files(make_demo_corpus(tmp_path / name, samples=12, seed=seed))
                           for name, seed in (("a", 3), ("b", 3), ("c", 4)))
    assert first == again and "flow_demo_tokenizer.json" in first and any(k.startswith("images/") for k in first)
    assert first != other
