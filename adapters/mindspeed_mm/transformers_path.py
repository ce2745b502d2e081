"""MindSpeed-MM's ``pretrain_transformers.py CONFIG.yaml`` (the Qwen3-VL / Qwen3.5 recipes): which
of the plugin's features can act there, decided when the plugin activates.

That path trains MindSpeed-MM's ``TransformersModel`` (a Hugging Face model, e.g. its
``transformers/qwen3vl``), one piece, sharded by FSDP2 or wrapped by Megatron's DDP: no
``VLMModel``, no Megatron pipeline stages, no Megatron attention or ViT modules.  Features whose
targets or premises are not there (:data:`NOT_ON_THIS_PATH`) are:

- refused at start-up (:class:`~mindspeed_flow.config.FlagError`, naming each and why) when asked
  for by name (``--flow-schedule``, ``--flow-pool``, an option that implies one, in the
  command line or ``MINDSPEED_FLOW_FLAGS``);
- turned off under ``--use-flowtrain`` alone, each with a line in the job's feature log saying
  why (:meth:`~mindspeed_flow.config.FlowConfig.without`), so the job runs with the others.

Flags on the command line: upstream's YAML reader (``mindspeed_mm/configs/read_yaml_config.py``,
run by ``pretrain_transformers.py`` before anything parses) rebuilds ``sys.argv`` from the YAML
alone, dropping every argument after the YAML (upstream's own ``--distributed-backend`` too).
The plugin read them at activation, before that; the tree records them as if they had come from
``MINDSPEED_FLOW_FLAGS``, so Megatron's namespace (parsed from the rebuilt command line) is
checked over them and agrees.
"""

from __future__ import annotations

import argparse
import os
from typing import Mapping, Optional, Sequence

from mindspeed_flow.config import FEATURES, FlagError, FlowConfig, add_flow_arguments, env_flags, flag_dest

ENTRY = "pretrain_transformers.py"
PIPELINE = ("this path's model is one TransformersModel (a Hugging Face model, sharded by FSDP2 or wrapped by "
            "Megatron's DDP), not MindSpeed-MM's VLMModel split into Megatron pipeline stages")
NOT_ON_THIS_PATH = {
    "schedule": f"it runs the plugin's pipeline schedules over Megatron's pipeline stages: {PIPELINE}; Megatron's "
                "forward_backward_no_pipelining runs each step",
    "pool": f"it carries ViT embeddings between encoder and backbone ranks of a decoupled Megatron pipeline: "
            f"{PIPELINE}",
    "allocator": f"its plan sets the Megatron pipeline / decoupled layout of VLMModel's parts: {PIPELINE}",
    "fused_attn": (
        "its targets (Megatron's DotProductAttention, VLMModel / MMGPTModel's dense-mask builders, MindSpeed-MM's "
        "Megatron ViTs) are not on this path; the Hugging Face model's attention follows the YAML's "
        "attn_implementation (the recipe's flash_attention_2 with TND layout is already varlen, and packing "
        "requires it at start-up)"),
}
# Options that turn their feature on when given (mindspeed_flow.config.tree.resolve).
IMPLYING_OPTIONS = {"--flow-pool-backend": "pool", "--flow-allocator-plan": "allocator",
                    "--flow-schedule-config": "schedule"}


def _through_launcher(argv: Sequence[str]) -> bool:
    """``argv`` is ``python -m mindspeed_flow.launch SCRIPT ...``'s: ``sys.argv[0]`` is the launcher's
    file once it runs, ``-m`` while ``site`` runs the ``.pth`` hook (the module name is not in it yet)."""
    from mindspeed_flow import launch

    return bool(argv) and (argv[0] == "-m" or os.path.realpath(argv[0]) == os.path.realpath(launch.__file__))


def entry_script(argv: Sequence[str]) -> Optional[str]:
    """The file name of the script a process runs, from its ``sys.argv`` at activation:
    ``argv[0]``, or the next argument through the plugin's launcher."""
    first = 1 if _through_launcher(argv) else 0
    return os.path.basename(argv[first]) if len(argv) > first else None


def _script_args(argv: Sequence[str]) -> list[str]:
    return list(argv[2 if _through_launcher(argv) else 1:])


def _flow_parser() -> argparse.ArgumentParser:
    return add_flow_arguments(argparse.ArgumentParser(prog="mindspeed-flow flags", allow_abbrev=False))


def flow_tokens(args: Sequence[str]) -> list[str]:
    """The plugin's own flags (with their values) out of a command line holding upstream's too,
    in order: ``args`` less what the plugin's parser leaves unknown."""
    _, unknown = _flow_parser().parse_known_args(list(args))
    tokens, rest = [], list(unknown)
    for arg in args:
        if rest and arg == rest[0]:
            rest.pop(0)
        else:
            tokens.append(arg)
    return tokens


def asked_by_name(args: Sequence[str], environ: Mapping[str, str]) -> set[str]:
    """Features whose own flag (or an option implying it) is on in ``args`` or ``MINDSPEED_FLOW_FLAGS``."""
    parser = _flow_parser()
    given = [parser.parse_known_args(list(source))[0] for source in (args, env_flags(environ))]

    def on(flag: str) -> bool:
        return any(getattr(namespace, flag_dest(flag), None) for namespace in given)

    named = {spec.name for spec in FEATURES if on(spec.flag)}
    return named | {feature for option, feature in IMPLYING_OPTIONS.items() if on(option)}


def fit_to_entry(config: FlowConfig, argv: Sequence[str], environ: Mapping[str, str]) -> FlowConfig:
    """``config`` for the script ``argv`` runs: unchanged unless it is :data:`ENTRY`; there,
    refuses the features of :data:`NOT_ON_THIS_PATH` asked for by name, turns off (with a
    note each) those ``--use-flowtrain`` turned on, and records the command line's flags for
    the later check of Megatron's namespace (see the module docstring)."""
    if entry_script(argv) != ENTRY:
        return config
    args = _script_args(argv)
    refused = sorted(asked_by_name(args, environ) & NOT_ON_THIS_PATH.keys())
    if refused:
        raise FlagError(f"{ENTRY} (MindSpeed-MM's TransformersModel path) cannot run "
                        + "; ".join(f"{name} ({NOT_ON_THIS_PATH[name]})" for name in refused)
                        + ". Drop those flags (--use-flowtrain alone runs the features that act on this path)")
    if config.enabled("packing"):
        from .transformers_packing import check_packing_yaml

        check_packing_yaml(args[0] if args else None)
    dropped = sorted(config.features & NOT_ON_THIS_PATH.keys())
    notes = [f"{name} off on {ENTRY} (on under --use-flowtrain): {NOT_ON_THIS_PATH[name]}" for name in dropped]
    return config.without(dropped, notes, environment=(*env_flags(environ), *flow_tokens(args)))
