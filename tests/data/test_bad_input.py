"""Bad input: each kind is counted in ``loader.stats``, logged with file, line and sample id,
and handled by its policy (skip, or fail naming the place); overlong samples by theirs."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from PIL import Image

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.batch import completed_samples
from mindspeed_flow.data.decode import BadSample, Decoder
from mindspeed_flow.data.overlong import fit, image_runs
from mindspeed_flow.data.source import Corpus, MalformedRecord
from mindspeed_flow.data.tokenizer import load_tokenizer

from data_corpus import demo_corpus

GOOD = 20
CAPACITY = 512


def _turns(user: str, answer: str = "A fine answer.") -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


# (line in bad.jsonl, kind, raw line)
BAD_LINES = [
    (1, "malformed_json", '{"messages": [{"role": "user", "content": "cut off'),
    (2, "malformed_json", "[1, 2, 3]"),
    (3, "missing_image", json.dumps({"messages": _turns("<image>\nWhat is it?"), "images": ["images/nope.png"]})),
    (4, "corrupt_image", json.dumps({"messages": _turns("<image>\nWhat is it?"), "images": ["images/garbage.png"]})),
    (5, "empty_conversation", json.dumps({"messages": [], "images": []})),
    (6, "empty_conversation", json.dumps({"messages": [{"role": "user", "content": "hello?"}], "images": []})),
    (7, "placeholder_mismatch", json.dumps({"messages": _turns("<image><image>\nCompare."),
                                            "images": ["images/00000_0.png"]})),
    (8, "overlong", json.dumps({"messages": _turns("Talk.", "word " * 2000), "images": []})),
    # image tokens spelled out in the text have no image behind them
    (9, "placeholder_mismatch", json.dumps({"messages": _turns("Look: <|image_pad|>"), "images": []})),
    (10, "empty_conversation", json.dumps({"system": 5, "messages": _turns("hello?"), "images": []})),
    # Pillow refuses to open it (over twice its MAX_IMAGE_PIXELS): DecompressionBombError
    (11, "corrupt_image", json.dumps({"messages": _turns("<image>\nWhat is it?"), "images": ["images/bomb.png"]})),
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = demo_corpus(tmp_path_factory, samples=GOOD)
    (root / "images" / "garbage.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    Image.new("1", (20000, 10000)).save(root / "images" / "bomb.png")
    (root / "bad.jsonl").write_text("".join(raw + "\n" for _, _, raw in BAD_LINES))
    return root


def test_skip_counts_each_kind_logs_the_place_and_keeps_the_good(corpus, caplog):
    loader = FlowDataLoader(corpus, None, capacity=CAPACITY, num_workers=2, window=4, overlong="drop")
    with caplog.at_level(logging.WARNING, logger="mindspeed_flow.data"):
        ids = [i for batch in loader for i in batch["sample_ids"]]
    expected = {kind: sum(1 for _, k, _ in BAD_LINES if k == kind) for _, kind, _ in BAD_LINES}
    assert {k: v for k, v in loader.stats.bad.items() if v} == expected
    assert loader.stats.samples_seen == GOOD + len(BAD_LINES)
    assert len(ids) == loader.stats.samples_packed == GOOD
    assert not any(i.startswith("bad.jsonl") for i in ids)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for line, kind, _ in BAD_LINES:
        assert re.search(rf"{kind}: \S*bad\.jsonl sample bad\.jsonl:{line}\b.*policy: skip", logged), (line, kind)


@pytest.mark.parametrize("line", [1, 3, 4, 5, 7, 9, 10, 11])
def test_fail_raises_naming_kind_file_and_line(corpus, tmp_path, line):
    only = tmp_path / "one_bad.jsonl"
    only.write_text("\n" * (line - 1) + BAD_LINES[line - 1][2] + "\n")  # keep the line number
    (tmp_path / "flow_demo_tokenizer.json").write_bytes((corpus / "flow_demo_tokenizer.json").read_bytes())
    loader = FlowDataLoader(tmp_path, None, capacity=CAPACITY, num_workers=0, bad_input="fail",
                            image_root=corpus)
    kind = BAD_LINES[line - 1][1]
    with pytest.raises(ValueError, match=rf"{kind}: \S*one_bad\.jsonl sample one_bad\.jsonl:{line}\b.*policy: fail"):
        list(loader)
    assert loader.stats.bad[kind] == 1


def test_overlong_error_policy_fails_naming_the_sample(corpus):
    loader = FlowDataLoader(corpus / "bad.jsonl", None, capacity=CAPACITY, num_workers=0, overlong="error")
    with pytest.raises(ValueError, match=r"overlong: \S*bad\.jsonl sample bad\.jsonl:8\b.*> capacity 512"):
        list(loader)


def test_a_malformed_json_list_shard_fails_at_open_naming_the_file(tmp_path):
    (tmp_path / "broken.json").write_text('[{"messages": []},\n {"messages": ')
    with pytest.raises(MalformedRecord, match=r"broken\.json: malformed JSON .*line 2"):
        Corpus.open(tmp_path)


def _long_multimodal_sample(corpus):
    """A decoded record with four images between long text: 600+ tokens."""
    record = {"messages": _turns("<image> intro " + "text " * 60 + "<image><image>" + " more" * 80 + "<image>",
                                 "answer " * 150),
              "images": [f"images/{name}" for name in sorted(p.name for p in (corpus / "images").iterdir())
                         if name != "garbage.png"][:4]}
    path = corpus.parent / "long_sample" / "long.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(record) + "\n")
    decoder = Decoder(Corpus.open(path), load_tokenizer(None, corpus), image_root=corpus, max_pixels=112 * 112)
    sample = decoder(0)
    assert not isinstance(sample, BadSample), sample
    return sample, decoder.tokenizer.special.image_pad


@pytest.mark.parametrize("capacity", [97, 160, 300])
def test_split_cuts_between_image_runs_and_keeps_every_token_and_pixel(corpus, capacity):
    sample, image_id = _long_multimodal_sample(corpus)
    assert len(sample) > 2 * capacity
    chunks = fit(sample, capacity, "split", image_id)
    assert len(chunks) >= 2 and all(0 < len(c) <= capacity for c in chunks)
    assert torch.equal(torch.cat([c.input_ids for c in chunks]), sample.input_ids)
    assert torch.equal(torch.cat([c.position_ids for c in chunks], dim=1), sample.position_ids)
    assert torch.equal(torch.cat([c.pixel_values for c in chunks]), sample.pixel_values)
    assert torch.equal(torch.cat([c.image_grid_thw for c in chunks]), sample.image_grid_thw)
    for c in chunks:  # each chunk's image tokens belong to its own images, whole
        tokens = int((c.input_ids == image_id).sum())
        assert tokens == int((c.image_grid_thw.prod(dim=1) // 4).sum())
        assert c.pixel_values.shape[0] == int(c.image_grid_thw.prod(dim=1).sum())
    bounds = set(torch.tensor([len(c) for c in chunks]).cumsum(0).tolist()[:-1])
    assert not any(start < b < end for start, end in image_runs(sample, image_id) for b in bounds)
    assert [c.sample_id for c in chunks] == [f"{sample.sample_id}#{k}/{len(chunks)}" for k in range(len(chunks))]
    truncated = fit(sample, capacity, "truncate", image_id)
    assert len(truncated) == 1 and torch.equal(truncated[0].input_ids, chunks[0].input_ids)


def test_an_image_longer_than_the_capacity_cannot_be_split(corpus):
    sample, image_id = _long_multimodal_sample(corpus)
    longest_run = max(end - start for start, end in image_runs(sample, image_id))
    assert fit(sample, longest_run - 1, "split", image_id) is None
    assert fit(sample, longest_run, "split", image_id) is not None


def test_split_policy_in_the_loader_packs_chunks_within_capacity(corpus):
    loader = FlowDataLoader(corpus / "bad.jsonl", None, capacity=CAPACITY, num_workers=0, overlong="split")
    batches = list(loader)
    ids = [i for b in batches for i in b["sample_ids"]]
    chunks = [i for i in ids if i.startswith("bad.jsonl:8#")]
    assert len(chunks) >= 4 and loader.stats.bad["overlong"] == 0
    assert completed_samples(ids) == 1 and completed_samples(ids[:-1]) == 0  # the last chunk completes it
    assert loader.stats.chunks == len(ids) and loader.stats.samples_packed == 1
    assert all(b["input_ids"].shape[1] <= CAPACITY for b in batches)
    for b in batches:  # every chunk's first label is masked like any segment's
        assert bool((b["labels"][0, b["cu_seqlens"][:-1].long()] == -100).all())


@pytest.mark.parametrize("raw, reason", [
    ('{"messages": [{"role": "user", "content": "cut off', r"malformed JSON \("),
    (json.dumps({"messages": "not a list", "images": []}), r"'messages' must be a list of turns, got str 'not a list'"),
])
def test_a_bad_record_is_reported_once_with_what_is_wrong(corpus, tmp_path, raw, reason):
    """The sample id appears once (a malformed line used to print ``x.jsonl:1`` twice) and the
    reason says what is wrong (``"messages": "not a list"`` used to be "no messages")."""
    only = tmp_path / "one_bad.jsonl"
    only.write_text(raw + "\n")
    (tmp_path / "flow_demo_tokenizer.json").write_bytes((corpus / "flow_demo_tokenizer.json").read_bytes())
    loader = FlowDataLoader(tmp_path, None, capacity=CAPACITY, num_workers=0, bad_input="fail")
    with pytest.raises(ValueError, match=rf"sample one_bad\.jsonl:1: {reason}") as info:
        list(loader)
    assert str(info.value).count("one_bad.jsonl:1") == 1, str(info.value)
