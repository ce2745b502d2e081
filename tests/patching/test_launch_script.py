"""The MindSpeed-MM launch example (``scripts/mindspeed_mm/``) and ``doctor --src``'s check of
it, against the pinned MindSpeed-MM / MindSpeed sources (``tests/support/pinned_upstream.py``).

The check reads the flags the trees declare with ``ast``; that it agrees with the real
parser (Megatron's ``parse_args`` with MindSpeed's and MindSpeed-MM's extensions and the
plugin's) is ``tests/upstream/test_launch_example_parse.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mindspeed_flow.patching.launch_check import check_launch_script, example_scripts
from mindspeed_flow.patching.launch_script import LaunchScriptError, read_training_command
from pinned_upstream import upstream_sources

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "scripts" / "mindspeed_mm" / "finetune_qwen2_5_vl_7b_flowtrain.sh"
UPSTREAM_EXAMPLE = Path("examples") / "qwen2.5vl" / "finetune_qwen2_5_vl_7b.sh"


@pytest.fixture(scope="module")
def roots() -> list[Path]:
    sources = upstream_sources()
    return [sources.mindspeed_mm, sources.mindspeed]


def line_of(path: Path, text: str) -> int:
    """The 1-based line of ``path`` that holds ``text`` (exactly one)."""
    lines = [i for i, line in enumerate(path.read_text().splitlines(), start=1) if text in line]
    assert len(lines) == 1, (text, lines)
    return lines[0]


def doctor_src(roots: list[Path], *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mindspeed_flow.cli", "doctor", "--json"]
    for root in roots:
        command += ["--src", str(root)]
    return subprocess.run(command + list(extra), capture_output=True, text=True, timeout=180)


def overlay(source: Path, target: Path, changed: dict[str, str | None]) -> Path:
    """``target`` looks like ``source`` (symlinks) except the files in ``changed``: new text,
    or absent for None.  Only the folders on a changed file's path are real folders."""
    for relative, text in changed.items():
        folder_src, folder_dst = source, target
        for part in Path(relative).parts[:-1]:
            folder_dst.mkdir(parents=True, exist_ok=True)
            for entry in folder_src.iterdir():
                if entry.name != part and not (folder_dst / entry.name).exists():
                    (folder_dst / entry.name).symlink_to(entry)
            folder_src, folder_dst = folder_src / part, folder_dst / part
        folder_dst.mkdir(parents=True, exist_ok=True)
        for entry in folder_src.iterdir():
            if entry.name != Path(relative).name and not (folder_dst / entry.name).exists():
                (folder_dst / entry.name).symlink_to(entry)
        if text is not None:
            (folder_dst / Path(relative).name).write_text(text)
    return target


def test_doctor_src_passes_the_example_on_the_pinned_upstream(roots):
    assert EXAMPLE in example_scripts()  # beside the Qwen3-VL one (test_launch_yaml.py)
    proc = doctor_src(roots)
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdicts = [line for line in proc.stderr.splitlines() if line.startswith("launch script ")]
    assert len(verdicts) == len(example_scripts())
    (verdict,) = [line for line in verdicts if line.startswith(f"launch script {EXAMPLE}: ")]
    assert verdict.startswith(f"launch script {EXAMPLE}: ok: ")
    owners = {k: int(v) for k, v in re.findall(r"(Megatron|MindSpeed-MM|MindSpeed|mindspeed-flow) (\d+)", verdict)}
    assert owners["mindspeed-flow"] == 1 and owners["MindSpeed-MM"] == 4
    assert owners["Megatron"] > 30 and owners["MindSpeed"] >= 3  # --use-fused-rmsnorm, --use-flash-attn, ...
    for file in ("pretrain_vlm.py", "./examples/qwen2.5vl/model_7b.json", "./mindspeed_mm/tools/tools.json"):
        assert file in verdict


def test_example_is_upstreams_arguments_plus_the_plugin(roots):
    """A copy of upstream's argument list, so the example follows what upstream runs."""
    ours = read_training_command(EXAMPLE)
    theirs = read_training_command(roots[0] / UPSTREAM_EXAMPLE)
    assert [w.text for w in ours.args if w.text != "--use-flowtrain"] == [w.text for w in theirs.args]
    assert "--use-flowtrain" in [w.text for w in ours.args]
    launcher = [w.text for w in ours.launcher]
    assert launcher[0] == "torchrun" and launcher[-2:] == ["-m", "mindspeed_flow.launch"]
    assert ours.entry.text == theirs.entry.text == "pretrain_vlm.py"


def test_reader_sees_the_arguments_bash_passes(tmp_path):
    """The example run by bash with a stand-in ``torchrun`` (records its argv) and empty
    Ascend ``set_env.sh`` files: the reader's words are bash's, bar unevaluated arithmetic."""
    ascend, bin_dir, work = tmp_path / "Ascend", tmp_path / "bin", tmp_path / "MindSpeed-MM"
    for env_file in ("cann/set_env.sh", "nnal/atb/set_env.sh"):
        (ascend / env_file).parent.mkdir(parents=True)
        (ascend / env_file).write_text("")
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGV_OUT"\n')
    (bin_dir / "torchrun").chmod(0o755)
    work.mkdir()
    (work / "pretrain_vlm.py").write_text("")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "ASCEND_HOME": str(ascend), "ARGV_OUT": str(tmp_path / "argv")}
    proc = subprocess.run(["bash", str(EXAMPLE)], cwd=work, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    argv = (tmp_path / "argv").read_text().splitlines()
    command = read_training_command(EXAMPLE)
    assert argv == [w.text for w in command.launcher[1:]] + [command.entry.text] + [
        bash if "$((" in ours.text else ours.text for ours, bash in zip(command.args, argv[-len(command.args):])]
    assert argv[argv.index("--global-batch-size") + 1] == "192"  # MBS 1 x 48 steps x DP (8 / TP 1 / PP 2 / CP 1)


def test_planted_unknown_flag_fails_naming_flag_and_line(roots, tmp_path):
    text = EXAMPLE.read_text().replace("    --use-flowtrain\n", "    --use-flowtrain \\\n    --use-flowtrian\n")
    planted = tmp_path / "planted.sh"
    planted.write_text(text)
    proc = doctor_src(roots, "--launch-script", str(planted))
    assert proc.returncode == 1
    line = line_of(planted, "--use-flowtrian")
    assert f"{planted}:{line}: --use-flowtrian: no parser declares this flag" in proc.stderr
    assert "did you mean --use-flowtrain?" in proc.stderr
    assert "launch script" in proc.stderr and EXAMPLE.name not in proc.stderr  # --launch-script replaces the default


def test_renamed_upstream_flag_fails_naming_flag_and_line(roots, tmp_path):
    config = Path("mindspeed_mm") / "configs" / "config.py"
    source = (roots[0] / config).read_text()
    assert source.count('"--mm-tool"') == 1
    renamed = overlay(roots[0], tmp_path / "MindSpeed-MM", {str(config): source.replace('"--mm-tool"', '"--mm-tools"')})
    result = check_launch_script(EXAMPLE, [renamed, roots[1]])
    assert [(f.line, f.subject) for f in result.findings] == [(line_of(EXAMPLE, "--mm-tool "), "--mm-tool")]
    assert "did you mean --mm-tools?" in result.findings[0].problem
    assert check_launch_script(EXAMPLE, [roots[0], roots[1]]).findings == []  # the original passes


def test_missing_or_broken_tree_file_is_named_with_the_line_that_names_it(roots, tmp_path):
    model = "examples/qwen2.5vl/model_7b.json"
    gone = overlay(roots[0], tmp_path / "gone", {model: None})
    (finding,) = check_launch_script(EXAMPLE, [gone, roots[1]]).findings
    assert finding.line == line_of(EXAMPLE, 'MM_MODEL="./examples/qwen2.5vl/model_7b.json"')
    assert finding.subject == "--mm-model" and "no such file" in finding.problem
    broken = overlay(roots[0], tmp_path / "broken", {model: '{"text_decoder": '})
    (finding,) = check_launch_script(EXAMPLE, [broken, roots[1]]).findings
    assert finding.subject == "--mm-model" and "not valid JSON" in finding.problem


def test_inline_flag_values_are_checked_too(roots, tmp_path):
    script = tmp_path / "inline.sh"
    script.write_text(EXAMPLE.read_text().replace("    --mm-model $MM_MODEL \\\n",
                                                  "    --mm-model=./examples/qwen2.5vl/model_7B.json \\\n"))
    (finding,) = check_launch_script(script, roots).findings
    assert (finding.line, finding.subject) == (line_of(script, "--mm-model="), "--mm-model")
    assert finding.problem.startswith("./examples/qwen2.5vl/model_7B.json: no such file")


def test_value_counts_are_checked(roots, tmp_path):
    text = (EXAMPLE.read_text().replace("    --bf16 \\\n", "    --bf16 true \\\n")
            .replace("    --seed 42 \\\n", "    --seed \\\n"))
    script = tmp_path / "values.sh"
    script.write_text(text)
    findings = {f.subject: (f.line, f.problem) for f in check_launch_script(script, roots).findings}
    assert set(findings) == {"--bf16", "--seed"}
    assert findings["--bf16"][0] == line_of(script, "--bf16 true")
    assert findings["--bf16"][1].startswith("takes no value, given 1 (") and "arguments.py:" in findings["--bf16"][1]
    assert findings["--seed"][1].startswith("takes 1 value(s), given 0")


def test_script_without_a_plugin_flag_is_refused(roots, tmp_path):
    script = tmp_path / "plain.sh"
    script.write_text(EXAMPLE.read_text().replace("    --use-flowtrain\n", ""))
    (finding,) = check_launch_script(script, roots).findings
    assert finding.subject == "plugin" and "add --use-flowtrain" in finding.problem


def test_every_upstream_qwen2_5_vl_finetune_script_passes_but_for_the_plugin_flag(roots):
    """No false alarms: upstream's own Megatron-path launch scripts use only declared flags
    and existing files; the one finding is that they do not turn the plugin on."""
    scripts = sorted((roots[0] / "examples" / "qwen2.5vl").glob("finetune_qwen2_5_vl_*b.sh"))
    assert len(scripts) == 4
    for script in scripts:
        assert [f.subject for f in check_launch_script(script, roots).findings] == ["plugin"], script


def test_not_checked_without_mindspeed_sources(roots):
    result = check_launch_script(EXAMPLE, [roots[0]])
    assert not result.failed and "no MindSpeed (mindspeed/arguments.py" in result.not_checked


def test_launch_script_needs_src(capsys):
    from mindspeed_flow.cli import main

    with pytest.raises(SystemExit, match="--launch-script needs --src"):
        main(["doctor", "--launch-script", str(EXAMPLE)])


def test_shell_reader_expands_variables_and_keeps_their_lines(tmp_path):
    script = tmp_path / "s.sh"
    script.write_text(
        'A="--x 1"\n'                               # 1
        "export B=${UNSET:-fallback}  # comment\n"  # 2
        "C=$((2*3))\n"                              # 3
        "echo start.py > /dev/null\n"               # 4: not a launcher
        "python3 -u train.py $A '--y' \"$B\" \\\n"  # 5
        "    --z=$C --w `hostname` > out.log 2>&1 | tee log\n"  # 6
    )
    command = read_training_command(script)
    assert [w.text for w in command.launcher] == ["python3", "-u"] and command.entry.text == "train.py"
    assert [(w.text, w.line) for w in command.args] == [
        ("--x", 1), ("1", 1), ("--y", 5), ("fallback", 2), ("--z=$((2*3))", 6), ("--w", 6), ("`hostname`", 6)]


def test_shell_reader_names_the_line_of_an_unterminated_quote(tmp_path):
    script = tmp_path / "bad.sh"
    script.write_text('A=1\nGPT_ARGS="\n    --lr 1\n')
    with pytest.raises(LaunchScriptError, match=rf"{re.escape(str(script))}:2: unterminated double quote"):
        read_training_command(script)
