"""Loss-driven mixing over two real FlowDataLoaders (a multimodal and a text-only demo
corpus): the ratio follows the losses within bounds, and a resumed mixer makes the same
choices and yields the same batches."""

from __future__ import annotations

import itertools
import json
import pickle
import shutil

import pytest

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.demo import make_demo_corpus
from mindspeed_flow.recipes.mixing import SOURCE_KEY, LossDrivenMixer, MixingConfig


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    mm = make_demo_corpus(root / "mm", samples=24, seed=0)
    text = root / "text"
    text.mkdir()
    shutil.copy(mm / "flow_demo_tokenizer.json", text)  # the demo tokenizer the loader looks for
    (text / "part-0000.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Tell me something about shapes. " * (1 + i % 3)},
                                                     {"role": "assistant", "content": "A square is a rectangle whose four sides have the same length. " * (1 + i % 4)}]}) + "\n"
                            for i in range(40)))
    return mm, text


def make_mixer(corpora, config):
    mm, text = corpora
    loaders = [FlowDataLoader(src, None, capacity=512, num_workers=0, seed=1, window=4) for src in (mm, text)]
    return LossDrivenMixer(*loaders, config=config)


def run(mixer, steps, losses={"multimodal": 3.0, "text": 1.0}):
    out = []
    for batch in itertools.islice(mixer, steps):
        out.append((batch[SOURCE_KEY], tuple(batch["sample_ids"])))
        mixer.report_loss(batch[SOURCE_KEY], losses[batch[SOURCE_KEY]])
    return out


def test_ratio_follows_losses_within_bounds(corpora):
    mixer = make_mixer(corpora, MixingConfig(base=0.5, low=0.2, high=0.7, gamma=1.0, seed=3))
    assert mixer.ratio == 0.5
    mixer.report_loss("multimodal", 3.0)
    mixer.report_loss("text", 1.0)
    assert mixer.ratio == pytest.approx(0.7)  # 0.75 by the rule, clipped to high
    mixer.report_loss("text", 1.0 + 4.0 / (1 - 0.9))  # text's average becomes 5.0
    assert mixer.ratio == pytest.approx(3.0 / 8.0)
    steps = run(mixer, 20)
    assert {s for s, _ in steps} == {"multimodal", "text"}
    assert all(ids for _, ids in steps)
    with pytest.raises(ValueError, match="unknown mixing source 'video'"):
        mixer.report_loss("video", 1.0)
    with pytest.raises(ValueError, match="low <= base <= high"):
        MixingConfig(base=0.95, high=0.9)


def test_resumed_mixer_makes_the_same_choices(corpora):
    config = MixingConfig(base=0.5, low=0.1, high=0.9, seed=7)
    first = make_mixer(corpora, config)
    head = run(first, 6)
    state = pickle.loads(pickle.dumps(first.state_dict()))  # as torch.save stores it in a checkpoint
    tail = run(first, 10)
    resumed = make_mixer(corpora, config)
    resumed.load_state_dict(state)
    assert resumed.ratio == pytest.approx(state["ratio"])
    assert run(resumed, 10) == tail
    assert head != tail[:6]
