"""The flags through Megatron's parser contract.

``megatron.training`` is not in the megatron-core wheel, so the contract is rebuilt here the
way ``megatron.training.arguments.parse_args(extra_args_provider=None,
ignore_unknown_args=False)`` builds it (``allow_abbrev=False``, Megatron's flags, then the
caller's provider, then a strict parse).  With ``MEGATRON_LM_SRC`` pointing at a Megatron-LM
checkout the same checks also run against its real ``parse_args``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import replace

import pytest

from mindspeed_flow.adapters.megatron.training import with_flow_arguments
from mindspeed_flow.config import ENV_VAR, FEATURE_NAMES, FlowConfig, add_flow_arguments, flags_requested
from mindspeed_flow.patches import core as core_patches
from mindspeed_flow.patching import PatchRegistry
from subprocess_utils import last_json, run_python
from upstream_imports import require_importable

MEGATRON_STANDIN = '''
"""Stand-in for megatron.training.arguments (not on PyPI): the parse_args contract of core_v0.12.1."""
import argparse

def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser.add_argument("--num-layers", type=int)
    parser.add_argument("--use-flash-attn", action="store_true")
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    if ignore_unknown_args:
        args, _ = parser.parse_known_args()
    else:
        args = parser.parse_args()
    return args

def validate_args(args, defaults={}):
    return args
'''


def megatron_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    parser.add_argument("--num-layers", type=int)
    return parser


def mm_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """What MindSpeed-MM passes as extra_args_provider: its own flags."""
    parser.add_argument("--mm-data", type=str)
    return parser


def parse(argv, provider=mm_provider):
    return with_flow_arguments(provider)(megatron_parser()).parse_args(argv)


def test_use_flowtrain_turns_every_feature_on_and_no_flow_x_off():
    args = parse(["--num-layers", "2", "--mm-data", "d.json", "--use-flowtrain", "--no-flow-allocator"])
    assert args.num_layers == 2 and args.mm_data == "d.json"
    config = FlowConfig.from_namespace(args, environ={})
    assert config.features == frozenset(FEATURE_NAMES) - {"allocator"}
    assert config.pool_backend == "shm"  # one node (no launcher's WORLD_SIZE / LOCAL_WORLD_SIZE)


def test_use_flowtrain_turns_the_allocator_on_only_with_a_plan():
    """A launch script plus --use-flowtrain must start: without a plan there is nothing to apply."""
    without = FlowConfig.from_namespace(parse(["--use-flowtrain"]), environ={})
    assert "allocator" not in without.features and "schedule" in without.features
    with_plan = FlowConfig.from_namespace(parse(["--use-flowtrain", "--flow-allocator-plan", "p.yaml"]),
                                          environ={})
    assert "allocator" in with_plan.features
    explicit = FlowConfig.from_namespace(parse(["--flow-allocator"]), environ={})
    assert explicit.features == {"allocator"}  # then the patch asks for the plan by name


def test_single_feature_flags_without_the_master_flag():
    config = FlowConfig.from_namespace(parse(["--flow-pool-backend", "mooncake"]), environ={})
    assert config.features == {"pool"}
    assert config.pool_backend == "mooncake"
    assert FlowConfig.from_namespace(parse(["--flow-conv-matmul"]), environ={}).features == {"conv_matmul"}
    assert FlowConfig.from_namespace(parse([]), environ={}).features == frozenset()


def test_packing_alone_turns_the_varlen_attention_on_and_says_so():
    """(issue 19, defect 2) A pack reaches MindSpeed-MM's attention with one causal mask over
    the whole pack unless fused_attn makes it honour cu_seqlens: --flow-packing alone brings
    fused_attn with it, and the job's feature line says why."""
    config = FlowConfig.from_namespace(parse(["--flow-packing", "--flow-pool-backend", "mooncake"]), environ={})
    assert config.features == {"packing", "fused_attn", "pool"}
    text = config.describe()
    assert text.startswith("packing, pool, fused_attn (pool backend mooncake); fused_attn on with --flow-packing")
    assert "attend to the other samples of its pack" in text
    env_only = FlowConfig.from_argv([], {ENV_VAR: "--flow-packing"})
    assert env_only.features == {"packing", "fused_attn"}
    assert FlowConfig.from_argv(["--flow-fused-attn"], environ={}).notes == ()  # nothing implied


@pytest.mark.parametrize("argv, env, packing", [
    (["--flow-packing", "--no-flow-fused-attn"], {}, "--flow-packing:"),
    (["--use-flowtrain", "--no-flow-fused-attn"], {}, "--flow-packing (on under --use-flowtrain):"),
    (["--no-flow-fused-attn"], {ENV_VAR: "--use-flowtrain"}, "--flow-packing (on under --use-flowtrain):"),
    (["--flow-packing"], {ENV_VAR: "--no-flow-fused-attn"}, "--flow-packing:"),
])
def test_packing_with_the_varlen_attention_off_is_refused_naming_both_flags(argv, env, packing):
    from mindspeed_flow.config import FlagError

    with pytest.raises(FlagError) as refused:
        FlowConfig.from_argv(argv, env)
    message = str(refused.value)
    assert message.startswith(f"--no-flow-fused-attn with {packing}")
    assert "attend to the other samples of its pack" in message and "--no-flow-packing" in message


def test_no_packing_leaves_the_attention_as_chosen():
    config = FlowConfig.from_argv(["--use-flowtrain", "--no-flow-packing", "--no-flow-fused-attn"], environ={})
    assert "packing" not in config.features and "fused_attn" not in config.features and config.notes == ()


def test_strict_parser_rejects_unknown_and_abbreviated_flags(capsys):
    with pytest.raises(SystemExit):
        parse(["--flow-bogus"])
    assert "unrecognized arguments: --flow-bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(["--flow-pack"])  # allow_abbrev=False: no prefix matching
    with pytest.raises(SystemExit):
        parse(["--flow-pool-backend", "nvlink"])
    assert "invalid choice: 'nvlink'" in capsys.readouterr().err


def test_help_lists_every_flag():
    text = with_flow_arguments(None)(megatron_parser()).format_help()
    for flag in ["--use-flowtrain", "--flow-packing", "--no-flow-packing", "--flow-schedule",
                 "--flow-pool-backend", "--flow-allocator", "--flow-fused-attn", "--flow-conv-matmul"]:
        assert flag in text


def test_registration_is_idempotent_across_paths():
    """MindSpeed's feature and Megatron's provider may both add the flags to one parser."""
    parser = add_flow_arguments(add_flow_arguments(megatron_parser()))
    args = with_flow_arguments(add_flow_arguments)(parser).parse_args(["--use-flowtrain"])
    assert args.use_flowtrain is True


def test_environment_flags_and_command_line_precedence():
    env = {ENV_VAR: "--use-flowtrain --no-flow-pool"}
    assert "pool" not in FlowConfig.from_argv([], env).features
    assert "packing" in FlowConfig.from_argv([], env).features
    assert "pool" in FlowConfig.from_argv(["--flow-pool"], env).features  # command line wins
    assert FlowConfig.from_argv(["--no-flow-packing"], env).features == (
        frozenset(FEATURE_NAMES) - {"pool", "packing", "allocator"})  # no plan: allocator off


def test_contradiction_is_a_clear_error():
    with pytest.raises(ValueError, match="--no-flow-pool contradicts --flow-pool-backend shm"):
        FlowConfig.from_argv(["--no-flow-pool", "--flow-pool-backend", "shm"], environ={})


def test_flags_requested_only_by_turning_something_on():
    assert flags_requested(["--use-flowtrain"], {})
    assert flags_requested(["--flow-pool-backend=shm"], {})
    assert flags_requested([], {ENV_VAR: "--flow-packing"})
    assert not flags_requested(["--no-flow-packing", "--num-layers", "2"], {})
    assert not flags_requested([], {})


@pytest.fixture
def megatron_standin(tmp_path, monkeypatch):
    (tmp_path / "megatron_args_standin.py").write_text(MEGATRON_STANDIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "megatron_args_standin"
    sys.modules.pop("megatron_args_standin", None)


def test_core_patches_make_the_strict_parse_accept_the_flags(megatron_standin, monkeypatch):
    """The declared core patches, retargeted at the stand-in, applied through the registry."""
    patches = [replace(p, target=p.target.replace("megatron.training.arguments", megatron_standin))
               for p in core_patches.PATCHES if p.module == "megatron.training.arguments"]
    registry = PatchRegistry(patches)
    registry.enable({"core"})
    try:
        module = importlib.import_module(megatron_standin)
        assert [r.status for r in registry.report()] == ["applied", "applied"]
        monkeypatch.setattr(sys, "argv", ["pretrain_vlm.py", "--num-layers", "4", "--use-flowtrain",
                                          "--no-flow-schedule", "--mm-data", "x"])
        args = module.parse_args(mm_provider, False)
        assert args.num_layers == 4 and args.mm_data == "x"
        module.validate_args(args, {})
        assert "schedule" not in FlowConfig.from_namespace(args, environ={}).features
        monkeypatch.setattr(sys, "argv", ["pretrain_vlm.py", "--no-flow-pool", "--flow-pool-backend", "shm"])
        with pytest.raises(ValueError, match="contradicts"):
            module.validate_args(module.parse_args(), {})
    finally:
        registry.remove()
    monkeypatch.setattr(sys, "argv", ["pretrain_vlm.py", "--use-flowtrain"])
    with pytest.raises(SystemExit):  # unpatched, Megatron's strict parser rejects the flag
        module.parse_args()


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_SRC"),
                    reason="set MEGATRON_LM_SRC to a Megatron-LM checkout (core_v0.12.1) to run against its parse_args")
def test_real_megatron_lm_parse_args_accepts_the_flags():
    code = '''
    import json, sys
    from megatron.training import arguments, initialize
    sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--use-flowtrain", "--no-flow-pool"]
    args = initialize.parse_args(None, False)
    print(json.dumps({"alias_wrapped": hasattr(initialize.parse_args, "__wrapped__"),
                      "use_flowtrain": args.use_flowtrain, "flow_pool": args.flow_pool}))
    '''
    env = {"PYTHONPATH": os.environ["MEGATRON_LM_SRC"]}
    proc = run_python(code, ["--use-flowtrain"], env=env)
    require_importable(proc, os.environ["MEGATRON_LM_SRC"])  # skip: triton (Megatron-LM HEAD)
    out = last_json(proc)
    assert out == {"alias_wrapped": True, "use_flowtrain": True, "flow_pool": False}
    plain = run_python(code, env=env)  # no flag on the interpreter's command line: not active
    assert plain.returncode != 0 and "unrecognized arguments: --use-flowtrain" in plain.stderr
