"""Loss-driven mixing of two real FlowDataLoaders (a multimodal and a text-only demo corpus)
through ``MixtureLoader``: the ratio rule and its bounds, the draws following the ratio, and
exact resume (the rest of a resumed run equals the uninterrupted one; no batch twice)."""

from __future__ import annotations

import json
import pickle
import random
import shutil
from dataclasses import replace

import pytest

from mindspeed_flow.data import FlowDataLoader, MixtureLoader
from mindspeed_flow.data.demo import make_demo_corpus
from mindspeed_flow.data.errors import ResumeMismatch
from mindspeed_flow.data.mixture import SOURCE_KEY
from mindspeed_flow.recipes.mixing import LossDrivenRatio, MixingConfig


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    mm = make_demo_corpus(root / "mm", samples=96, seed=0)
    text = root / "text"
    text.mkdir()
    shutil.copy(mm / "flow_demo_tokenizer.json", text)  # the demo tokenizer the loader looks for
    (text / "part-0000.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": "Tell me something about shapes. " * (1 + i % 3)},
                                                     {"role": "assistant", "content": "A square is a rectangle whose four sides have the same length. " * (1 + i % 4)}]}) + "\n"
                            for i in range(160)))
    return mm, text


def make_mixture(corpora, config):
    mm, text = corpora
    return MixtureLoader(FlowDataLoader(mm, None, capacity=512, num_workers=1, seed=1, window=4),
                         FlowDataLoader(text, None, capacity=512, num_workers=0, seed=1, window=4), config)


def loss_of(source: str, step: int) -> float:
    """A multimodal loss falling from above the text loss to below it: the ratio moves."""
    return 3.0 - 0.2 * step if source == "multimodal" else 1.0 + 0.02 * step


def run(mixture, steps, first_step=0):
    out = []
    for step in range(first_step, first_step + steps):
        batch = next(mixture)
        out.append((batch[SOURCE_KEY], tuple(batch["sample_ids"])))
        mixture.report_loss(batch[SOURCE_KEY], loss_of(batch[SOURCE_KEY], step))
    return out


def test_ratio_rule_and_bounds():
    ratio = LossDrivenRatio(MixingConfig(base=0.5, low=0.2, high=0.7, gamma=1.0))
    assert ratio.ratio == 0.5
    ratio.report("multimodal", 3.0)
    assert ratio.ratio == 0.5  # one source without a loss yet
    ratio.report("text", 1.0)
    assert ratio.ratio == pytest.approx(0.7)  # 0.75 by the rule, clipped to high
    ratio.report("text", 1.0 + 4.0 / (1 - 0.9))  # text's average becomes 5.0
    assert ratio.ratio == pytest.approx(3.0 / 8.0)
    skewed = LossDrivenRatio(MixingConfig(base=0.25, low=0.0, high=1.0, gamma=2.0))
    skewed.report("multimodal", 2.0)
    skewed.report("text", 1.0)
    assert skewed.ratio == pytest.approx(0.25 * 4 / (0.25 * 4 + 0.75 * 1))
    with pytest.raises(ValueError, match="unknown mixing source 'video'"):
        ratio.report("video", 1.0)
    with pytest.raises(ValueError, match="reported loss nan is not a finite number"):
        ratio.report("text", float("nan"))
    with pytest.raises(ValueError, match="low <= base <= high"):
        MixingConfig(base=0.95, high=0.9)


def test_draws_follow_the_loss_driven_ratio(corpora):
    config = MixingConfig(base=0.5, low=0.2, high=0.8, seed=3)
    got = run(make_mixture(corpora, config), 14)
    # the same draws, replayed with the rule and the generator alone
    ratio, rng, expected = LossDrivenRatio(config), random.Random(config.seed), []
    for step in range(14):
        source = "multimodal" if rng.random() < ratio.ratio else "text"
        expected.append(source)
        ratio.report(source, loss_of(source, step))
    assert [s for s, _ in got] == expected
    assert {"multimodal", "text"} == set(expected)


def test_resumed_mixture_makes_the_same_choices_and_repeats_no_batch(corpora):
    config = MixingConfig(base=0.5, low=0.1, high=0.9, seed=7)
    first = make_mixture(corpora, config)
    head = run(first, 6)
    state = pickle.loads(pickle.dumps(first.state_dict()))  # as torch.save stores it in a checkpoint
    tail = run(first, 10, first_step=6)
    resumed = make_mixture(corpora, config)
    resumed.load_state_dict(state)
    assert resumed.ratio == pytest.approx(state["mixing"]["ratio"]) and resumed.draws == 6
    assert run(resumed, 10, first_step=6) == tail
    assert all(loader.epoch == 0 for loader in first.sources.values())  # still in the first epochs
    ids = [(source, sid) for source, ids in head + tail for sid in ids]  # both corpora have a part-0000.jsonl
    assert len(ids) == len(set(ids))
    other = make_mixture(corpora, replace(config, seed=8))
    with pytest.raises(ResumeMismatch, match="cannot resume this mixture state: seed: saved 7, now 8"):
        other.load_state_dict(state)
