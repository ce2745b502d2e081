"""The config tree: every option reaches it the same way from the command line and from
``MINDSPEED_FLOW_FLAGS``, the command line winning; one list of pool backends."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from mindspeed_flow.config import (
    ENV_VAR, FEATURES, MASTER_DEST, OPTIONS, POOL_BACKENDS, FlowConfig, add_flow_arguments, flag_dest,
)

# One value per option flag: (value on the command line, what the tree holds)
SAMPLES = {
    "--flow-schedule-config": (["layout.yaml"], "layout.yaml"),
    "--flow-pool-backend": (["shm"], "shm"),
    "--flow-allocator-plan": (["plan.yaml"], "plan.yaml"),
    "--flow-module-lr": (["text_decoder=0.5", "image_encoder.encoder=0.1"],
                         ("text_decoder=0.5", "image_encoder.encoder=0.1")),
    "--flow-module-lr-warmup": (["text_decoder=10"], ("text_decoder=10",)),
    "--flow-module-grad-clip": (["text_decoder=1.0"], ("text_decoder=1.0",)),
    "--flow-loss-weighting": (["*caption*=caption", "*=text"], ("*caption*=caption", "*=text")),
    "--flow-loss-weighting-beta": (["0.5"], 0.5),
}
# Another value of each, for the command line to win with.
OTHER = {"--flow-schedule-config": ["other.yaml"], "--flow-pool-backend": ["mooncake"],
         "--flow-allocator-plan": ["other.yaml"], "--flow-module-lr": ["text_decoder=2"],
         "--flow-module-lr-warmup": ["text_decoder=3"], "--flow-module-grad-clip": ["text_decoder=0.3"],
         "--flow-loss-weighting": ["*=all"], "--flow-loss-weighting-beta": ["0.25"]}
OPTION_FIELDS = [(branch, f.name, f.metadata["flag"]) for branch, cls in OPTIONS.items() for f in fields(cls)]


def option(config: FlowConfig, branch: str, name: str):
    return getattr(getattr(config, branch), name)


def test_every_flag_is_a_switch_or_an_option_of_the_tree():
    """A flag the tree does not hold would have to be read by some adapter on its own."""
    parser = add_flow_arguments(argparse.ArgumentParser(allow_abbrev=False))
    registered = {a.dest for a in parser._actions if a.dest != "help"}
    options = {flag_dest(flag) for _, _, flag in OPTION_FIELDS}
    assert registered == {MASTER_DEST, *(spec.dest for spec in FEATURES), *options}
    assert set(SAMPLES) == set(OTHER) == {flag for _, _, flag in OPTION_FIELDS}
    assert set(OPTIONS) == {"schedule", "pool", "allocator", "recipes", "system"}


@pytest.mark.parametrize("branch, name, flag", OPTION_FIELDS, ids=[flag for _, _, flag in OPTION_FIELDS])
def test_the_environment_route_gives_every_option_as_the_command_line_does(branch, name, flag):
    given, held = SAMPLES[flag]
    argv = ["--use-flowtrain", flag, *given]
    from_argv = FlowConfig.from_argv(argv, environ={})
    from_env = FlowConfig.from_argv([], {ENV_VAR: " ".join(argv)})
    assert option(from_argv, branch, name) == option(from_env, branch, name) == held
    assert from_argv == from_env
    # Megatron's args hold the command line's parse: None where the flag came from the environment
    megatron = add_flow_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args([])
    assert option(FlowConfig.from_namespace(megatron, {ENV_VAR: " ".join(argv)}), branch, name) == held


@pytest.mark.parametrize("branch, name, flag", OPTION_FIELDS, ids=[flag for _, _, flag in OPTION_FIELDS])
def test_the_command_line_wins_over_the_environment_for_every_option(branch, name, flag):
    env = {ENV_VAR: " ".join(["--use-flowtrain", flag, *SAMPLES[flag][0]])}
    config = FlowConfig.from_argv([flag, *OTHER[flag]], env)
    expected = FlowConfig.from_argv(["--use-flowtrain", flag, *OTHER[flag]], environ={})
    assert option(config, branch, name) == option(expected, branch, name) != SAMPLES[flag][1]


def test_defaults_when_no_option_is_given():
    config = FlowConfig.from_argv(["--use-flowtrain"], environ={})
    assert config.schedule.config is None and config.allocator.plan is None
    assert config.pool.backend == config.pool_backend == "shm"
    assert not config.recipes.values_given and config.recipes.loss_weighting_beta is None
    assert FlowConfig.from_argv(["--use-flowtrain", "--no-flow-pool"], environ={}).pool.backend is None


def test_the_switches_and_the_options_together_through_the_environment():
    """(issue 21) The environment route used to switch the schedule on and run Megatron's own
    layout: the tree holds the layout from the environment like the feature."""
    config = FlowConfig.from_argv(["--num-layers", "2"], {ENV_VAR: "--use-flowtrain --flow-schedule-config x.yaml"})
    assert config.enabled("schedule") and config.schedule.config == "x.yaml"
    assert config.environment == ("--use-flowtrain", "--flow-schedule-config", "x.yaml")


def test_the_default_pool_backend_is_shm_on_one_node_and_torch_across_nodes():
    """torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE say whether the job spans nodes: shared
    memory cannot reach another node's ranks; a backend given is kept either way."""
    one_node = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    two_nodes = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert FlowConfig.from_argv(["--use-flowtrain"], environ=one_node).pool_backend == "shm"
    assert FlowConfig.from_argv(["--flow-pool"], environ=two_nodes).pool_backend == "torch"
    given = ["--use-flowtrain", "--flow-pool-backend", "mooncake"]
    assert FlowConfig.from_argv(given, environ=two_nodes).pool_backend == "mooncake"
    assert FlowConfig.from_argv(["--use-flowtrain", "--no-flow-pool"], environ=two_nodes).pool_backend is None


def test_one_list_of_pool_backends():
    from mindspeed_flow.pool import BACKENDS
    from mindspeed_flow.pool.availability import backend_status

    parser = add_flow_arguments(argparse.ArgumentParser(allow_abbrev=False))
    (choices,) = [a.choices for a in parser._actions if a.dest == "flow_pool_backend"]
    assert BACKENDS is POOL_BACKENDS and tuple(choices) == POOL_BACKENDS
    assert tuple(backend_status()) == POOL_BACKENDS


def test_withholding_a_feature_drops_the_note_that_turned_it_on():
    """``--flow-packing`` turns fused_attn on with a note; an entry script that withholds
    fused_attn must not log both "fused_attn on" and "fused_attn off"."""
    config = FlowConfig.from_argv(["--flow-packing"], environ={})
    assert "fused_attn" in config.features and any(n.startswith("fused_attn on ") for n in config.notes)
    held = config.without(["fused_attn"], notes=["fused_attn off on this entry script: its targets are not there"])
    assert "fused_attn" not in held.features and "fused_attn" in held.withheld
    assert not any(n.startswith("fused_attn on ") for n in held.notes)
    assert "fused_attn off on this entry script" in held.describe()
    kept = config.without(["schedule"])
    assert kept.notes == config.notes
