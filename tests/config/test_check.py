"""Megatron's namespace checked against the tree the activation installed, and what
adapters read through :func:`mindspeed_flow.activation.flow_config`."""

from __future__ import annotations

import argparse
import logging

import pytest

from mindspeed_flow import activation
from mindspeed_flow.config import ENV_VAR, FlagError, FlowConfig, add_flow_arguments, cross_check


def megatron_args(argv):
    """Megatron's parse of the command line, with the plugin's flags registered (core patch)."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--num-layers", type=int)
    return add_flow_arguments(parser).parse_args(argv)


@pytest.fixture
def installed():
    """Install a tree as the activation does (without the registry); forget it afterwards."""
    def install(argv, environ):
        config = FlowConfig.from_argv(argv, environ)
        activation.install_config(config)
        return config
    yield install
    activation.deactivate()


def test_the_same_command_line_agrees_with_the_tree():
    argv = ["--num-layers", "2", "--use-flowtrain", "--flow-schedule-config", "a.yaml", "--flow-module-lr",
            "text_decoder=0.5"]
    env = {ENV_VAR: "--no-flow-pool --flow-allocator-plan p.yaml --flow-loss-weighting-beta 0.5"}
    config = FlowConfig.from_argv(argv, env)
    assert cross_check(config, megatron_args(argv)) is config


def test_a_namespace_that_disagrees_is_refused_naming_each_flag_and_both_values():
    config = FlowConfig.from_argv(["--use-flowtrain", "--flow-schedule-config", "a.yaml"], environ={})
    with pytest.raises(FlagError) as refused:
        cross_check(config, megatron_args(["--use-flowtrain", "--flow-schedule-config", "b.yaml", "--no-flow-pool"]))
    message = str(refused.value)
    assert message.startswith("Megatron's arguments disagree with the flags the plugin was activated with")
    assert "--flow-schedule-config: 'b.yaml' in Megatron's arguments, 'a.yaml' at activation" in message
    assert "--flow-pool-backend: None in Megatron's arguments, 'shm' at activation" in message
    assert "features: " in message and "--flow-allocator-plan" not in message  # only what differs


def test_the_check_uses_the_environment_the_tree_was_resolved_over():
    """Megatron's args lack what came from MINDSPEED_FLOW_FLAGS; the check fills it from the
    tree's own environment, not from whatever the process's environment says later."""
    config = FlowConfig.from_argv([], {ENV_VAR: "--use-flowtrain --flow-schedule-config x.yaml"})
    assert cross_check(config, megatron_args([])) is config


def test_a_namespace_without_the_flags_registered_has_nothing_to_check():
    config = FlowConfig.from_argv(["--use-flowtrain"], environ={})
    assert cross_check(config, argparse.Namespace(optimization_level=2)) is config


def test_flow_config_reads_the_installed_tree_and_checks_namespaces(installed, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "--flow-conv-matmul")  # the process's environment now: not read again
    config = installed(["--flow-packing"], {ENV_VAR: "--flow-schedule-config x.yaml"})
    assert activation.flow_config() is config
    assert activation.flow_config(megatron_args(["--flow-packing"])) is config
    with pytest.raises(FlagError, match="'a.yaml' in Megatron's arguments, 'x.yaml' at activation"):
        activation.flow_config(megatron_args(["--flow-packing", "--flow-schedule-config", "a.yaml"]))


def test_flow_config_without_an_activation_resolves_with_the_same_precedence(monkeypatch):
    assert activation.current_config() is None
    monkeypatch.setenv(ENV_VAR, "--use-flowtrain --flow-schedule-config env.yaml")
    assert activation.flow_config(megatron_args([])).schedule.config == "env.yaml"
    assert activation.flow_config(megatron_args(["--flow-schedule-config", "cli.yaml"])).schedule.config == "cli.yaml"
    monkeypatch.setattr("sys.argv", ["pretrain_vlm.py", "--flow-schedule-config", "argv.yaml"])
    assert activation.flow_config().schedule.config == "argv.yaml"
    assert activation.current_config() is None  # nothing installed


def test_megatron_validate_args_logs_the_tree_and_refuses_a_disagreement(installed, caplog):
    from mindspeed_flow.adapters.megatron.training import validate_args_wrapper

    installed([], {ENV_VAR: "--flow-packing"})
    with caplog.at_level(logging.INFO, logger="mindspeed_flow.adapters.megatron.training"):
        validate_args_wrapper(lambda a, d=None: a, None, (megatron_args([]), {}), {})
    assert any(r.getMessage().startswith("mindspeed-flow: packing, fused_attn") for r in caplog.records)
    with pytest.raises(FlagError, match="features: 'conv_matmul' in Megatron's arguments"):
        validate_args_wrapper(lambda a, d=None: a, None, (megatron_args(["--no-flow-packing", "--flow-conv-matmul"]),
                                                          {}), {})
