"""Which features run on MindSpeed-MM's ``pretrain_transformers.py`` path (``transformers_path``):
asked for by name they are refused at start-up, naming each and why; under ``--use-flowtrain``
they are turned off with a note each; other scripts are untouched; the command line's flags,
which upstream's YAML reader drops, still agree with Megatron's namespace.  The real job is
``tests/upstream/test_real_job_qwen3vl.py``."""

from __future__ import annotations

import pytest

from mindspeed_flow import launch
from mindspeed_flow.adapters.mindspeed_mm.transformers_path import (
    NOT_ON_THIS_PATH, entry_script, fit_to_entry, flow_tokens,
)
from mindspeed_flow.config import FlagError, FlowConfig, add_flow_arguments, cross_check
from mindspeed_flow.config.flags import ENV_VAR

ENTRY = "/mm/pretrain_transformers.py"


def fitted(argv: list[str], env: str = "") -> FlowConfig:
    environ = {ENV_VAR: env} if env else {}
    return fit_to_entry(FlowConfig.from_argv(argv[1:], environ), argv, environ)


def megatron_namespace(argv: list[str]):
    """What Megatron parses from the command line upstream's YAML reader rebuilds (our flags registered)."""
    import argparse

    return add_flow_arguments(argparse.ArgumentParser(allow_abbrev=False)).parse_known_args(argv)[0]


@pytest.mark.parametrize("argv", [
    ["/mm/pretrain_vlm.py", "--use-flowtrain"],
    ["-m", "pretrain_vlm.py", "--use-flowtrain"],
])
def test_other_scripts_keep_every_feature(argv):
    config = FlowConfig.from_argv(argv[1:], {})
    assert fitted(argv) == config and fitted(argv).withheld == frozenset()


@pytest.mark.parametrize("route", ["command line", "environment", "launcher", "launcher at site"])
def test_use_flowtrain_runs_the_features_that_act_and_says_why_the_others_are_off(route):
    flags = ["--use-flowtrain", "--flow-module-lr", "vit=0.5"]
    argv, env = {
        "command line": ([ENTRY, "c.yaml", *flags], ""),
        "environment": ([ENTRY, "c.yaml"], " ".join(flags)),
        "launcher": ([launch.__file__, ENTRY, "c.yaml", *flags], ""),
        "launcher at site": (["-m", ENTRY, "c.yaml", *flags], ""),  # sys.argv while site runs the .pth hook
    }[route]
    config = fitted(argv, env)
    assert config.features == {"conv_matmul", "packing", "recipes", "system"}
    off = set(NOT_ON_THIS_PATH) - {"allocator"}  # --use-flowtrain leaves it off without a plan anyway
    assert config.withheld == off
    assert config.pool_backend is None
    for name in off:
        reason = NOT_ON_THIS_PATH[name]
        assert f"{name} off on pretrain_transformers.py (on under --use-flowtrain): {reason}" in config.describe()
    # Megatron parses the YAML's command line, without our flags: it still agrees with the tree
    assert cross_check(config, megatron_namespace(["--lr", "1e-5"])) is config
    assert config.recipes.module_lr == ("vit=0.5",)


@pytest.mark.parametrize("flags, env, refused", [
    (["--use-flowtrain", "--flow-schedule", "--flow-conv-matmul"], "", ["schedule"]),
    ([], "--flow-fused-attn", ["fused_attn"]),
    (["--flow-pool-backend", "shm"], "", ["pool"]),
    (["--flow-allocator-plan", "plan.json"], "", ["allocator"]),
])
def test_a_feature_asked_for_by_name_is_refused_naming_it_and_why(flags, env, refused):
    with pytest.raises(FlagError) as error:
        fitted([ENTRY, "c.yaml", *flags], env)
    message = str(error.value)
    for name in refused:
        assert f"{name} ({NOT_ON_THIS_PATH[name]})" in message
    for name in set(NOT_ON_THIS_PATH) - set(refused):
        assert f"{name} (" not in message


def test_entry_script_and_the_plugin_flags_out_of_a_command_line():
    assert entry_script([launch.__file__, ENTRY, "c.yaml"]) == "pretrain_transformers.py"
    assert entry_script(["-m"]) is None
    tokens = flow_tokens(["c.yaml", "--lr", "0.1", "--use-flowtrain", "--flow-module-lr", "vit=0.1", "llm=1",
                          "--seed", "3", "--no-flow-system"])
    assert tokens == ["--use-flowtrain", "--flow-module-lr", "vit=0.1", "llm=1", "--no-flow-system"]
