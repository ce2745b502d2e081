"""The plugin's packing loader trains on the text MindSpeed-MM's own chat template makes.

For the Qwen3-VL recipes' ``template: qwen3_vl_nothink`` (no default system turn) and the
Qwen2.5-VL jobs' ``qwen2vl`` ("You are a helpful assistant."), ``template_tokens_driver.py``
(beside it, in a subprocess: the processor needs the job's torchvision stand-in) gives each
of a few records of the harness's corpus (``realjob_assets.make_corpus``: an image and a
tagged question, an answer) to the plugin's ``FlowDataLoader`` with ``template=`` and to the
pinned MindSpeed-MM's ``get_template_and_fix_tokenizer`` + ``SupervisedDatasetProcessor``,
both with the tiny Qwen3-VL's processor (``realjob_qwen3vl_assets``: 16-pixel patches).

Asserted: the same ``input_ids`` and ``labels``, record by record, under each template; and
the two templates' sequences differ by the system turn alone (so equality under one is not
equality under the other: the test can tell them apart).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import realjob_assets
import realjob_qwen3vl_assets
from conftest import MODEL_DEPENDENCIES, REAL_JOB_DEPENDENCIES, require
from pinned_upstream import upstream_sources
from realjob import STANDINS, TORCHVISION_STANDIN

DRIVER = Path(__file__).resolve().parent / "template_tokens_driver.py"
RECORDS = 4
TEMPLATES = ("qwen3_vl_nothink", "qwen2vl")


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> tuple[Path, Path]:
    require(MODEL_DEPENDENCIES + REAL_JOB_DEPENDENCIES, "the chat template token test")
    root = tmp_path_factory.mktemp("template_tokens")
    corpus = realjob_assets.make_corpus(root / "corpus", RECORDS, seed=3)
    return corpus, realjob_qwen3vl_assets.make_processor(root / "processor")


@pytest.fixture(scope="module")
def tokens(assets, tmp_path_factory) -> dict[str, dict]:
    corpus, processor = assets
    sources = upstream_sources()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"PYTHONPATH": ":".join(map(str, (STANDINS, TORCHVISION_STANDIN, sources.mindspeed_mm,
                                                  sources.mindspeed))),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    path = tmp_path_factory.mktemp("out") / "tokens.pt"
    proc = subprocess.run([sys.executable, str(DRIVER), str(corpus), str(processor), ",".join(TEMPLATES),
                           str(RECORDS), str(path)], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"driver failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("template", TEMPLATES)
def test_the_plugin_tokenizes_each_record_as_upstreams_template(tokens, template):
    plugin, upstream = tokens[template]["plugin"], tokens[template]["upstream"]
    assert len(plugin) == len(upstream) == RECORDS
    for index, ((ids, labels), (up_ids, up_labels)) in enumerate(zip(plugin, upstream)):
        assert ids == up_ids, f"record {index}: input_ids differ under {template}"
        assert labels == up_labels, f"record {index}: labels differ under {template}"
        assert realjob_assets.IMAGE_PAD_ID in ids and any(label != -100 for label in labels)


def test_the_two_templates_differ_by_the_system_turn_alone(tokens):
    for (nothink, _), (qwen2vl, _) in zip(tokens["qwen3_vl_nothink"]["upstream"], tokens["qwen2vl"]["upstream"]):
        assert len(qwen2vl) > len(nothink) and qwen2vl[-len(nothink):] == nothink
