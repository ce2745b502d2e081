"""The chat template decides the system turn: ``qwen2vl`` adds "You are a helpful assistant."
to a record without one, ``qwen3_vl_nothink`` (the Qwen3-VL recipes') adds none; a template
whose text the loader does not reproduce is refused at start-up, and a loader state saved
under one template does not resume under another."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest

from mindspeed_flow.adapters.mindspeed_mm.data import FlowDatasetSpec
from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.conversation import IGNORE, TEMPLATE_SYSTEMS, tokenize_conversation
from mindspeed_flow.data.errors import ResumeMismatch, UnsupportedTemplate
from mindspeed_flow.data.tokenizer import load_tokenizer

from data_corpus import demo_corpus

SAMPLES = 6
SETTINGS = dict(capacity=4096, window=4, num_workers=0, shuffle=False, max_pixels=112 * 112)
MESSAGES = [{"role": "user", "content": "What is it?"}, {"role": "assistant", "content": "A red square."}]
PROMPT = "<|im_start|>user\nWhat is it?<|im_end|>\n<|im_start|>assistant\n"
ANSWER = "A red square.<|im_end|>\n"


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo_corpus(tmp_path_factory, samples=SAMPLES)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return load_tokenizer(None, corpus)


@pytest.mark.parametrize("template, system_text", [
    ("qwen2vl", "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"),
    ("qwen3_vl_nothink", ""),
])
def test_each_template_gives_its_texts_tokens(tokenizer, template, system_text):
    """The ids are the tokenizer's for the template's whole text; only the answer is trained."""
    ids, labels = tokenize_conversation(MESSAGES, [], tokenizer, system=TEMPLATE_SYSTEMS[template])
    prompt = tokenizer.encode(system_text + PROMPT)
    assert ids == prompt + tokenizer.encode(ANSWER)
    assert labels == [IGNORE] * len(prompt) + tokenizer.encode(ANSWER)


def test_a_records_own_system_turn_wins_under_either_template(tokenizer):
    record_system = [{"role": "system", "content": "Be brief."}, *MESSAGES]
    results = {tokenize_conversation(record_system, [], tokenizer, system=s)[0] == tokenizer.encode(
        "<|im_start|>system\nBe brief.<|im_end|>\n" + PROMPT + ANSWER) for s in TEMPLATE_SYSTEMS.values()}
    assert results == {True}


def _tokens(corpus, template: str) -> tuple[int, list[str]]:
    loader = FlowDataLoader(corpus, None, template=template, **SETTINGS)
    ids = [sample_id for batch in loader for sample_id in batch["sample_ids"]]
    return loader.stats.tokens, ids


def test_the_loader_decodes_with_the_templates_system_turn(corpus, tokenizer):
    """Same samples; under ``qwen3_vl_nothink`` each is shorter by exactly qwen2vl's system turn."""
    qwen2vl, ids2 = _tokens(corpus, "qwen2vl")
    nothink, ids3 = _tokens(corpus, "qwen3_vl_nothink")
    system_turn = len(tokenizer.encode("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"))
    assert sorted(ids2) == sorted(ids3) and len(ids2) == SAMPLES
    assert qwen2vl - nothink == SAMPLES * system_turn > 0


def test_the_decoder_carries_the_template_to_worker_processes(corpus):
    loader = FlowDataLoader(corpus, None, template="qwen3_vl_nothink", **SETTINGS)
    assert pickle.loads(pickle.dumps(loader._decoder)).default_system is None


@pytest.mark.parametrize("template", ["qwen3_vl", "chatml"])
def test_a_template_the_loader_does_not_reproduce_is_refused(corpus, template):
    with pytest.raises(UnsupportedTemplate, match=rf"template: '{template}' is not .*'qwen2vl', 'qwen3_vl_nothink'"):
        FlowDataLoader(corpus, None, template=template, **SETTINGS)


def _dataset_param(corpus, **basic) -> dict:
    return {"basic_parameters": {"dataset": str(corpus / "part-0000.jsonl"), **basic}, "preprocess_parameters": {}}


def test_the_data_configs_template_reaches_the_spec_and_an_unknown_one_stops_the_job(corpus):
    assert FlowDatasetSpec.from_dataset_param(_dataset_param(corpus)).template == "qwen2vl"  # none named
    spec = FlowDatasetSpec.from_dataset_param(_dataset_param(corpus, template="qwen3_vl_nothink"))
    assert spec.template == "qwen3_vl_nothink"
    with pytest.raises(UnsupportedTemplate, match=r"dataset_param\.basic_parameters\.template: 'qwen3_vl' .*"
                                                  r"supported: \['qwen2vl', 'qwen3_vl_nothink'\]"):
        FlowDatasetSpec.from_dataset_param(_dataset_param(corpus, template="qwen3_vl"))


def test_a_state_saved_under_another_template_is_refused(corpus):
    saved = FlowDataLoader(corpus, None, template="qwen3_vl_nothink", **SETTINGS).state_dict()
    with pytest.raises(ResumeMismatch, match="template: saved 'qwen3_vl_nothink', now None"):
        FlowDataLoader(corpus, None, **SETTINGS).load_state_dict(saved)


def test_a_state_saved_before_the_template_was_recorded_resumes_under_qwen2vl(corpus):
    loader = FlowDataLoader(corpus, None, **SETTINGS)
    older = {k: v for k, v in loader.state_dict().items() if k != "template"}
    loader.load_state_dict(older)
    with pytest.raises(ResumeMismatch, match="template: saved None, now 'qwen3_vl_nothink'"):
        FlowDataLoader(corpus, None, template="qwen3_vl_nothink", **SETTINGS).load_state_dict(older)


@pytest.mark.parametrize("template", sorted(TEMPLATE_SYSTEMS))
def test_an_empty_system_field_gets_the_templates_default_as_upstream_gives_it(corpus, tmp_path, template):
    """Upstream's template encodes ``system or default_system``: a record whose ``system`` is
    ``""`` (or null) is tokenized as one without the field."""
    blank = tmp_path / "blank_system"
    shutil.copytree(corpus, blank)
    for shard in blank.glob("*.jsonl"):
        records = [json.loads(line) for line in shard.read_text().splitlines() if line.strip()]
        shard.write_text("".join(json.dumps({**r, "system": "" if k % 2 else None}) + "\n"
                                 for k, r in enumerate(records)))
    assert _tokens(blank, template) == _tokens(corpus, template)
