"""The ``schedule`` adapter reads its layout from the config tree: ``--flow-schedule-config``
in ``MINDSPEED_FLOW_FLAGS`` runs that layout (issue 21: the environment route used to switch
the schedule on and run Megatron's own layout, the file being read from Megatron's args only)."""

from __future__ import annotations

import argparse

import pytest

from mindspeed_flow import activation
from mindspeed_flow.adapters.megatron import schedule as adapter
from mindspeed_flow.config import ENV_VAR, FlowConfig, add_flow_arguments

LAYOUT = "regions:\n  - {name: llm, layers: 4}\nruntime: {timeout_s: 7.5, max_pending_sends: 3}\n"


def megatron_args(argv, pipeline=2):
    args = add_flow_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_args(argv)
    args.pipeline_model_parallel_size = pipeline
    return args


def validate(args):
    adapter.validate_args_wrapper(lambda a, d=None: a, None, (args, {}), {})
    return adapter.SETTINGS


@pytest.fixture
def clean(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    yield monkeypatch
    adapter.configure()
    activation.deactivate()


@pytest.mark.parametrize("installed", [False, True], ids=["adapter-alone", "activated"])
def test_the_layout_named_in_the_environment_runs(tmp_path, clean, installed):
    layout = tmp_path / "layout.yaml"
    layout.write_text(LAYOUT)
    clean.setenv(ENV_VAR, f"--use-flowtrain --flow-schedule-config {layout}")
    if installed:
        activation.install_config(FlowConfig.from_argv([]))
    args = megatron_args([])
    assert args.flow_schedule_config is None  # Megatron's parse of the command line has no file
    settings = validate(args)
    assert settings.layout is not None and len(settings.layout(2, 1)) == 1
    assert (settings.options.wait.timeout_s, settings.options.max_pending_sends) == (7.5, 3)
    assert adapter.runtime_runs(megatron_args([], pipeline=1))  # a layout is named: ours runs at PP=1 too


def test_the_command_line_layout_wins_over_the_environment(tmp_path, clean):
    (tmp_path / "env.yaml").write_text("regions: [nope]\n")  # would fail to load if it were read
    (tmp_path / "cli.yaml").write_text(LAYOUT)
    clean.setenv(ENV_VAR, f"--flow-schedule-config {tmp_path / 'env.yaml'}")
    settings = validate(megatron_args(["--flow-schedule-config", str(tmp_path / "cli.yaml")]))
    assert settings.options.max_pending_sends == 3
