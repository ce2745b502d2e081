"""``doctor --src``'s check of the Qwen3-VL launch example
(``scripts/mindspeed_mm/finetune_qwen3vl_8b_flowtrain.sh``: ``pretrain_transformers.py
CONFIG.yaml`` plus the plugin) against the pinned MindSpeed-MM / MindSpeed sources: the flags are
those upstream's YAML reader rebuilds from the YAML's ``gpt_args``
(``mindspeed_flow/patching/launch_yaml.py``), the plugin's follow the YAML.  That the rebuilt
arguments get the real parser's verdict is ``tests/upstream/test_launch_example_qwen3vl.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from mindspeed_flow.patching.launch_check import check_launch_script, example_scripts
from mindspeed_flow.patching.launch_script import read_training_command
from mindspeed_flow.patching.launch_yaml import rebuilt_arguments
from pinned_upstream import upstream_sources
from tests.patching.test_launch_script import doctor_src, line_of, overlay

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "scripts" / "mindspeed_mm" / "finetune_qwen3vl_8b_flowtrain.sh"
RECIPE = Path("examples") / "qwen3vl" / "qwen3vl_full_sft_8B.yaml"
UPSTREAM_EXAMPLE = Path("examples") / "qwen3vl" / "finetune_qwen3vl_8B.sh"


@pytest.fixture(scope="module")
def roots() -> list[Path]:
    sources = upstream_sources()
    return [sources.mindspeed_mm, sources.mindspeed]


def with_recipe(roots: list[Path], tmp_path: Path, old: str, new: str) -> list[Path]:
    """The MindSpeed-MM tree with ``old`` replaced by ``new`` in the recipe's YAML."""
    text = (roots[0] / RECIPE).read_text()
    assert text.count(old) == 1, old
    return [overlay(roots[0], tmp_path / "MindSpeed-MM", {str(RECIPE): text.replace(old, new)}), roots[1]]


def test_doctor_src_passes_the_qwen3vl_example(roots):
    assert EXAMPLE in example_scripts()
    proc = doctor_src(roots, "--launch-script", str(EXAMPLE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (verdict,) = [line for line in proc.stderr.splitlines() if line.startswith("launch script ")]
    assert verdict.startswith(f"launch script {EXAMPLE}: ok: "), verdict
    owners = {k: int(v) for k, v in re.findall(r"(Megatron|MindSpeed-MM|MindSpeed|mindspeed-flow) (\d+)", verdict)}
    # every gpt_args key of the recipe, its --mm-* flags, and the plugin's one flag
    recipe = yaml.safe_load((roots[0] / RECIPE).read_text())
    assert sum(owners.values()) == len(recipe["gpt_args"]) + 3 + 1 and owners["mindspeed-flow"] == 1
    for file in (str(RECIPE), "pretrain_transformers.py", "./examples/qwen3vl/fsdp2_config.yaml",
                 "./mindspeed_mm/tools/tools.json"):
        assert file in verdict


def test_example_is_upstreams_job_plus_the_plugin(roots):
    """Upstream's entry and YAML; the plugin's launcher and flag; upstream's --distributed-backend,
    which the YAML reader drops, left out."""
    ours, theirs = read_training_command(EXAMPLE), read_training_command(roots[0] / UPSTREAM_EXAMPLE)
    assert ours.entry.text == theirs.entry.text == "pretrain_transformers.py"
    assert ours.args[0].text == theirs.args[0].text == str(RECIPE)
    assert [w.text for w in ours.args[1:]] == ["--use-flowtrain"]
    assert [w.text for w in ours.launcher][-2:] == ["-m", "mindspeed_flow.launch"]


def test_upstreams_own_script_is_named_for_the_flag_the_reader_drops(roots):
    script = roots[0] / UPSTREAM_EXAMPLE
    findings = {f.subject: (f.line, f.problem) for f in check_launch_script(script, roots).findings}
    assert set(findings) == {"--distributed-backend", "plugin"}
    line, problem = findings["--distributed-backend"]
    assert line == line_of(script, "--distributed-backend nccl") and problem.startswith("dropped: ")


@pytest.mark.parametrize("old, new, subject, problem", [
    ("  seed: 42\n", "  seed: 42\n  use_flowtrian: true\n", "gpt_args --use-flowtrian", "no parser declares this flag"),
    ("  log_tps: true\n", "  log_tps: false\n", "gpt_args --log-tps", "takes no value, given 1"),
    ("  seed: 42\n", "  seed: 42\n  use_flowtrain: true\n", "gpt_args --use-flowtrain", "a plugin flag in the YAML is not a route"),
    ("FSDP2_PATH: &FSDP2_PATH ./examples/qwen3vl/fsdp2_config.yaml",
     "FSDP2_PATH: &FSDP2_PATH ./examples/qwen3vl/fsdp2_gone.yaml", "--fsdp2-config-path", "no such file"),
])
def test_a_bad_yaml_is_named_with_the_key_and_the_script_line(roots, tmp_path, old, new, subject, problem):
    result = check_launch_script(EXAMPLE, with_recipe(roots, tmp_path, old, new))
    matching = [f for f in result.findings if f.subject.endswith(subject)]
    assert len(matching) == 1, result.findings
    assert problem in matching[0].problem
    assert matching[0].line == line_of(EXAMPLE, "CONFIG=examples/qwen3vl/qwen3vl_full_sft_8B.yaml")


def test_a_missing_yaml_is_named(roots, tmp_path):
    script = tmp_path / "gone.sh"
    script.write_text(EXAMPLE.read_text().replace("qwen3vl_full_sft_8B.yaml", "qwen3vl_gone.yaml"))
    (finding,) = check_launch_script(script, roots).findings
    assert finding.subject == "config" and "examples/qwen3vl/qwen3vl_gone.yaml: no such file" in finding.problem


def test_the_reader_rebuilds_arguments_as_upstream_does():
    config = {"MM_TOOL_PATH": "tools.json",
              "gpt_args": {"parallel": {"use_torch_fsdp2": True, "no_flag": False}, "lr": 1e-5,
                           "eval_iters": [1, 2]},
              "lora_args": {"lora_r": 8}, "data": {"dataset": "ignored"}}
    words = rebuilt_arguments(config, "c.yaml", 7)
    assert [w.text for w in words] == ["--use-torch-fsdp2", "--no-flag", "False", "--lr", "1e-05",
                                       "--eval-iters", "1", "--eval-iters", "2", "--lora-r", "8",
                                       "--mm-data", "c.yaml", "--mm-model", "c.yaml", "--mm-tool", "tools.json"]
    assert {w.line for w in words} == {7}
