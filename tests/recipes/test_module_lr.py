"""Per-module learning rates on megatron-core's real ``_get_param_groups`` and
``OptimizerParamScheduler``: each group's LR after N steps is the configured schedule, and
with every multiplier at 1 training is bit-identical to the unpatched run."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from torch import nn

from megatron_param_groups import megatron_param_groups
from mindspeed_flow.adapters.megatron import recipes as megatron_core_recipes
from mindspeed_flow.patches import recipes as recipes_patches
from mindspeed_flow.patching import PatchRegistry
from mindspeed_flow.recipes.module_lr import MODULE_KEY, RecipeConfigError, describe_groups, module_lr_settings

MAX_LR, MIN_LR, WARMUP, DECAY, STEPS = 1e-2, 1e-4, 3, 12, 8


class TinyVLM(nn.Module):
    """MindSpeed-MM's module names, tiny."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image_encoder = nn.Module()
        self.image_encoder.encoder = nn.Linear(6, 8)
        self.image_encoder.projector = nn.Linear(8, 8)
        self.text_decoder = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
        from megatron.core.distributed import DistributedDataParallelConfig
        self.ddp_config = DistributedDataParallelConfig()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.text_decoder(self.image_encoder.projector(torch.tanh(self.image_encoder.encoder(x))))


def schedule_lr(step: int) -> float:
    """Megatron's linear warm-up + cosine decay, written out independently."""
    if step <= WARMUP:
        return MAX_LR * step / WARMUP
    ratio = (step - WARMUP) / (DECAY - WARMUP)
    return MIN_LR + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (MAX_LR - MIN_LR)


def train(mults: list[str] | None, warmups: list[str] | None, patched: bool):
    """STEPS AdamW steps; returns the model and the optimizer's groups."""
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    registry = PatchRegistry(recipes_patches.PATCHES)
    megatron_core_recipes.configure(argparse.Namespace(flow_module_lr=mults, flow_module_lr_warmup=warmups))
    if patched:
        registry.enable({"recipes"})
    try:
        import megatron.core.optimizer as opt_module
        model = TinyVLM()
        groups = megatron_param_groups([model], MAX_LR, MIN_LR)
        optimizer = torch.optim.AdamW(groups, lr=MAX_LR)
        sched = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=MAX_LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP,
                          lr_decay_steps=DECAY, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                          wd_incr_steps=DECAY, wd_incr_style="constant")
        gen = torch.Generator().manual_seed(1)
        for _ in range(STEPS):
            x = torch.randn(4, 6, generator=gen)
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sched.step(1)
        return model, optimizer.param_groups
    finally:
        registry.remove()
        megatron_core_recipes.reset()
        assert _get_param_groups is opt_module._get_param_groups


def test_each_group_follows_its_configured_schedule():
    _, groups = train(["image_encoder.encoder=0.1", "image_encoder.projector=2"],
                      ["image_encoder.projector=10"], patched=True)
    by_module = {g.get(MODULE_KEY): g for g in groups}
    assert {"image_encoder.encoder", "image_encoder.projector", None} <= set(by_module)
    base = schedule_lr(STEPS)
    for group in groups:
        expected = {"image_encoder.encoder": base * 0.1,
                    "image_encoder.projector": base * 2 * STEPS / 10}.get(group.get(MODULE_KEY), base)
        assert group["lr"] == pytest.approx(expected, rel=1e-12), group.get(MODULE_KEY)
    # the text decoder was not configured: it stays in Megatron's own (wd / no-wd) groups
    assert sum(len(g["params"]) for g in groups if g.get(MODULE_KEY) is None) == 6


def test_all_multipliers_one_is_bit_identical_to_no_patch():
    ones = ["image_encoder.encoder=1", "image_encoder.projector=1.0", "text_decoder=1"]
    patched, patched_groups = train(ones, None, patched=True)
    plain, plain_groups = train(None, None, patched=False)
    assert len(patched_groups) == len(plain_groups)
    for (name, a), (_, b) in zip(patched.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b), name


def test_a_multiplier_changes_the_run():
    scaled, _ = train(["text_decoder=0.5"], None, patched=True)
    plain, _ = train(None, None, patched=False)
    assert not torch.equal(scaled.text_decoder[0].weight, plain.text_decoder[0].weight)


def test_a_zero_multiplier_stops_the_module_and_nothing_else():
    """``--flow-module-lr PREFIX=0``: the module's learning rate is 0 every step (AdamW's
    decoupled weight decay scales with it), so its weights stay as built; the others train."""
    frozen, groups = train(["image_encoder.encoder=0"], None, patched=True)
    initial = TinyVLM()
    for name, value in initial.image_encoder.encoder.state_dict().items():
        assert torch.equal(frozen.image_encoder.encoder.state_dict()[name], value), name
    assert {g["lr"] for g in groups if g.get(MODULE_KEY) == "image_encoder.encoder"} == {0.0}
    assert not torch.equal(frozen.text_decoder[0].weight, initial.text_decoder[0].weight)
    settings = module_lr_settings(["image_encoder.encoder=0", "vit=0.5", "text_decoder=1"], None)
    assert describe_groups(groups, settings) == "image_encoder.encoder x0 (2 tensors), vit x0.5 (0 tensors)"


@pytest.mark.parametrize("mults, warmups, message", [
    (["text_decoder"], None, "--flow-module-lr: 'text_decoder' is not PREFIX=VALUE"),
    (["text_decoder=-1"], None, "value must be a finite number >= 0"),
    (["text_decoder=inf"], None, "value must be a finite number >= 0"),
    (["text_decoder=abc"], None, "'abc' is not a finite number >= 0"),
    (None, ["text_decoder=1.5"], "--flow-module-lr-warmup: 'text_decoder=1.5'"),
    (["text_decoder=1", "text_decoder=2"], None, "module 'text_decoder' given twice"),
])
def test_bad_values_are_named(mults, warmups, message):
    with pytest.raises(RecipeConfigError, match=message.replace("(", r"\(")):
        module_lr_settings(mults, warmups)


def test_flags_in_megatrons_parser_and_imply_the_feature():
    from mindspeed_flow.config import FlowConfig, add_flow_arguments
    parser = add_flow_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ns = parser.parse_args(["--flow-module-lr", "text_decoder=0.5", "image_encoder.encoder=0.1"])
    assert ns.flow_module_lr == ["text_decoder=0.5", "image_encoder.encoder=0.1"]
    assert FlowConfig.from_namespace(ns, environ={}).enabled("recipes")
    assert not FlowConfig.from_namespace(parser.parse_args([]), environ={}).enabled("recipes")
    with pytest.raises(ValueError, match="--no-flow-recipes contradicts"):
        FlowConfig.from_namespace(parser.parse_args(["--no-flow-recipes", "--flow-module-lr", "text_decoder=2"]),
                                  environ={})
