"""``doctor --src``'s check of a YAML-driven launch (the Qwen3-VL example,
``pretrain_transformers.py CONFIG.yaml``) against the real parser.

The static check (``mindspeed_flow/patching/launch_yaml.py``) rebuilds the command line as
upstream's ``read_yaml_config.py`` does and checks its flags against the declarations read with
``ast``.  Here Megatron's real ``parse_args`` (MindSpeed's adaptor imported, MindSpeed-MM's
``mm_extra_args_provider``, started through ``mindspeed_flow.launch``: the probe of
``test_launch_example_parse.py``) decides on the same rebuilt lists: the recipe's own YAML
(``examples/qwen3vl/qwen3vl_full_sft_8B.yaml``, what the plugin's example runs) parses, a
misspelt key and a switch set to ``false`` are refused, and the static check agrees on each.
Only ``torch_npu`` / ``torchair`` are stood in (``standins/``).
"""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path

import yaml

from pinned_upstream import upstream_sources
from test_launch_example_parse import real_parses

from mindspeed_flow.patching.launch_check import check_flags
from mindspeed_flow.patching.launch_script import TrainingCommand, Word
from mindspeed_flow.patching.launch_yaml import rebuilt_arguments
from mindspeed_flow.patching.source_flags import flag_catalogue, source_files

RECIPE = Path("examples") / "qwen3vl" / "qwen3vl_full_sft_8B.yaml"


def test_static_yaml_check_and_real_parser_agree(runs, tmp_path):
    """(``runs``: the upstream environment gate, as in the other tests here.)"""
    sources = upstream_sources()
    recipe = yaml.safe_load((sources.mindspeed_mm / RECIPE).read_text())
    planted = {"example": {}, "misspelt_key": {"use_flowtrian": True}, "switch_false": {"log_tps": False}}
    configs = {}
    for name, change in planted.items():
        config = deepcopy(recipe)
        config["gpt_args"].update(change)
        configs[name] = config
    variants = {name: [w.text for w in rebuilt_arguments(config, str(RECIPE), 1)] for name, config in configs.items()}
    real = real_parses(variants, sources, tmp_path)

    assert real["example"]["ok"], real["example"]
    assert "unrecognized arguments: --use-flowtrian" in real["misspelt_key"]["error"]
    assert "unrecognized arguments: False" in real["switch_false"]["error"]
    files, missing = source_files([sources.mindspeed_mm, sources.mindspeed])
    assert not missing
    catalogue = flag_catalogue(files)
    for name, words in variants.items():
        command = TrainingCommand([], Word("pretrain_transformers.py", 1), [Word(w, 1) for w in words])
        findings, _ = check_flags(command, catalogue)
        assert real[name]["ok"] == (not findings), (name, real[name], findings)
