"""The recipe values reach the ``recipes`` adapter from the config tree: from
``MINDSPEED_FLOW_FLAGS`` exactly as from the command line (Megatron's parse of the command
line has ``None`` for each), the command line winning."""

from __future__ import annotations

import argparse

import pytest

from mindspeed_flow import activation
from mindspeed_flow.adapters.megatron import recipes
from mindspeed_flow.config import ENV_VAR, FlowConfig, add_flow_arguments

VALUES = ["--flow-module-lr", "text_decoder=0.5", "--flow-module-lr-warmup", "text_decoder=10",
          "--flow-module-grad-clip", "text_decoder=1.0", "--flow-loss-weighting", "*caption*=caption", "*=text",
          "--flow-loss-weighting-beta", "0.5"]


def megatron_args(argv):
    return add_flow_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)


def read(namespace=None):
    recipes.reset()
    try:
        recipes.configure(namespace)
        weighting = recipes.current_loss_weighting()
        return (recipes.current_settings(), recipes.current_clip(),
                weighting and (weighting.tasks, weighting.beta))
    finally:
        recipes.reset()


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    yield monkeypatch
    activation.deactivate()


def test_every_recipe_value_through_the_environment_as_on_the_command_line(clean):
    on_the_command_line = read(megatron_args(VALUES))
    settings, clip, weighting = on_the_command_line
    assert [(s.prefix, s.mult, s.warmup_steps) for s in settings] == [("text_decoder", 0.5, 10)]
    assert clip == {"text_decoder": 1.0} and weighting == (("caption", "text"), 0.5)
    clean.setenv(ENV_VAR, " ".join(f"'{v}'" for v in VALUES))
    assert read(megatron_args([])) == on_the_command_line
    activation.install_config(FlowConfig.from_argv([]))  # as the activation resolves it
    assert read(megatron_args([])) == read() == on_the_command_line


def test_the_command_line_wins_and_beta_is_not_hidden_by_a_default(clean):
    clean.setenv(ENV_VAR, " ".join(f"'{v}'" for v in VALUES))
    _, clip, weighting = read(megatron_args(["--flow-module-grad-clip", "text_decoder=0.3"]))
    assert clip == {"text_decoder": 0.3} and weighting == (("caption", "text"), 0.5)
    clean.setenv(ENV_VAR, "--flow-loss-weighting '*=text'")
    assert read(megatron_args([]))[2] == (("text",), 0.9)  # not given anywhere: the recipe's default
