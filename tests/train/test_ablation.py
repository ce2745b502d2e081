"""The main job's runs (train/runs.py) resolved from the shipped configs, in one process: the
ablation chain adds exactly one feature per run over the same config, the command line picks
the runs it says, and the text-only run's backbone sees the very token sequences the VLM's
does.  The runs themselves train in tests/train/test_e2e.py (``--ablation`` on the CI config)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from mindspeed_flow.train.config import load_config
from mindspeed_flow.train.runs import (
    ABLATION,
    FLOWTRAIN_FEATURES,
    RUN_NAMES,
    RunFeatures,
    ablation_chain,
    catalogue,
    is_baseline,
    select,
    text_only_run,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=["ci.yaml", "demo.yaml"])
def cfg(request):
    return load_config(ROOT / "configs" / "train" / request.param)


def _switched(before: RunFeatures, after: RunFeatures) -> set[str]:
    return {f.name for f in dataclasses.fields(RunFeatures) if getattr(before, f.name) != getattr(after, f.name)}


def test_each_run_of_the_chain_adds_exactly_one_feature_to_the_run_before(cfg):
    chain = ablation_chain(cfg)
    assert chain[0].name == "baseline" and chain[0].features == RunFeatures() and chain[0].previous is None
    assert chain[-1].name == "flowtrain" and chain[-1].features == FLOWTRAIN_FEATURES
    assert [spec.name for spec in chain[1:]] == [step.name for step in ABLATION]
    for before, after, step in zip(chain, chain[1:], ABLATION):
        assert _switched(before.features, after.features) == {step.switch}, (before.name, after.name)
        assert getattr(after.features, step.switch) is True
        assert (after.previous, after.adds) == (before.name, step.adds)
        assert after.cfg == before.cfg == cfg  # same samples, init, optimizer, ranks, steps
    assert [spec.kind for spec in chain] == ["baseline"] * 4 + ["flowtrain"]


def test_the_catalogue_keeps_the_best_baseline_and_the_text_only_bound_beside_the_chain(cfg):
    runs = catalogue(cfg)
    best_name, best_cfg = cfg.best_baseline()
    assert list(runs) == ["baseline", best_name, "baseline-thd", "three-phase", "packing", "varlen", "conv-matmul",
                          "flowtrain", "text-only"]
    assert runs[best_name].features == RunFeatures() and runs[best_name].cfg == best_cfg
    text = runs["text-only"]
    assert text == text_only_run(cfg)
    assert _switched(FLOWTRAIN_FEATURES, text.features) == {"conv_matmul", "decoupled", "text_only"}
    assert text.kind == "baseline" and text.previous is None  # co-located, outside the chain
    assert text.cfg.layout.baseline_pp == cfg.layout.text_only_pp
    assert dataclasses.replace(text.cfg, layout=cfg.layout) == cfg  # only its layout differs


def test_the_thd_and_three_phase_baselines_are_named_baselines_beside_the_chain(cfg):
    """``baseline-thd`` is the chain's ``conv-matmul`` run (packs, THD attention, Conv->Matmul,
    ViT in stage 0, Megatron's 1F1B) under a baseline's name, outside the chain;
    ``three-phase`` is the same data path with the three-phase schedule only, run by its own
    trainer; both (and the configured best baseline) are baselines every run is compared
    against, the chain's other runs are not."""
    runs = catalogue(cfg)
    chain = {spec.name: spec for spec in ablation_chain(cfg)}
    thd, phased = runs["baseline-thd"], runs["three-phase"]
    assert thd.features == chain["conv-matmul"].features and thd.kind == "baseline"
    assert _switched(thd.features, phased.features) == {"three_phase"} and phased.kind == "three-phase"
    assert thd.previous is phased.previous is None
    # each at its configured best PP (layout.best_thd_pp / best_three_phase_pp; null: baseline_pp), nothing else
    for spec, best in ((thd, cfg.layout.best_thd_pp), (phased, cfg.layout.best_three_phase_pp)):
        assert spec.cfg.layout.baseline_pp == (best or cfg.layout.baseline_pp)
        assert dataclasses.replace(spec.cfg, layout=cfg.layout) == cfg
    assert [name for name in runs if is_baseline(name)] == ["baseline", cfg.best_baseline()[0], "baseline-thd",
                                                            "three-phase"]


@pytest.mark.parametrize("switches, message", [
    ({"varlen": True}, "varlen attention takes one packed row"),
    ({"packing": True, "varlen": True, "decoupled": True}, "always runs packing, varlen attention and Conv->Matmul"),
    ({"packing": True, "varlen": True, "conv_matmul": True, "decoupled": True, "text_only": True},
     "no encoder to decouple"),
    ({"packing": True, "varlen": True, "conv_matmul": True, "decoupled": True, "three_phase": True},
     "three-phase schedule runs a co-located ViT"),
    ({"text_only": True, "three_phase": True}, "three-phase schedule runs a co-located ViT"),
])
def test_switches_that_no_trainer_runs_are_refused(switches, message):
    with pytest.raises(ValueError, match=message):
        RunFeatures(**switches)


def _phases(cfg, *argv: str) -> list[str]:
    from mindspeed_flow.train import cli
    from mindspeed_flow.train.job import Phases

    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["train", "config.yaml", *argv])
    return [spec.name for spec in select(cfg, Phases.from_args(args).with_best_baseline(cfg).runs)]


def test_the_command_line_picks_the_default_runs_all_of_them_or_one(cfg):
    assert _phases(cfg) == ["baseline", "baseline-thd", "flowtrain", "text-only"]
    assert _phases(cfg, "--ablation") == list(catalogue(cfg))
    for name in RUN_NAMES:
        assert _phases(cfg, "--only", name) == [name]
    assert _phases(cfg, "--parity") == []
    with pytest.raises(SystemExit):
        _phases(cfg, "--only", "flowtrain", "--ablation")


def test_the_text_only_backbone_sees_the_same_token_sequences():
    """Text only, every image token is embedded as a text token: the backbone's input has the
    VLM's sequence length and its text positions the same embeddings; the loss is over the
    same positions."""
    import torch

    from tiny_vlm import PLAIN, make_batches
    from mindspeed_flow.train.model import StageModule, build_plain_stage, init_vision_encoder

    batch = make_batches(1)[0]["batch"]
    vlm = StageModule(build_plain_stage(PLAIN, [PLAIN.llm_layers], 0),
                      vit=init_vision_encoder(PLAIN, conv_matmul=True, varlen=True))
    text = StageModule(build_plain_stage(PLAIN, [PLAIN.llm_layers], 0), text_only=True)
    with_images, text_only = vlm._embed(batch), text._embed(batch)
    assert text_only.shape == with_images.shape  # [S, B, H]
    is_text = (batch.input_ids != PLAIN.image_token_id).t()
    assert is_text.any() and not is_text.all()
    torch.testing.assert_close(text_only[is_text], with_images[is_text])
    assert not torch.allclose(text_only[~is_text], with_images[~is_text])  # images: the token's embedding instead
    assert text(batch).shape == vlm(batch).shape == batch.labels.shape
    with pytest.raises(ValueError, match="a text-only stage runs no ViT"):
        StageModule(build_plain_stage(PLAIN, [PLAIN.llm_layers], 0), vit=vlm.vit, text_only=True)
