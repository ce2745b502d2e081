"""``doctor --src``'s check of a MindSpeed-MM launch script that turns the plugin on.

The plugin's Ascend entry point is an upstream launch script with ``--use-flowtrain`` added
(``scripts/mindspeed_mm/``).  Upstream renames flags and moves example files between
releases, and Megatron's strict parser then stops the job at start-up on the cluster.  This
check meets that on the laptop instead: given MindSpeed-MM's tree (with Megatron's copy)
and MindSpeed's, every flag the script passes to ``pretrain_vlm.py`` must be declared by
Megatron, MindSpeed, MindSpeed-MM or the plugin (:mod:`.source_flags`) and get the number
of values it takes; the entry script and the example files it names inside the tree
(``--mm-model``, ``--mm-data``, ... JSON) must exist and JSON must parse; a plugin flag
must be on.  Each finding names the script line to edit.

A YAML-driven launch (``pretrain_transformers.py CONFIG.yaml``, the Qwen3-VL recipes) is
checked as it runs (:mod:`.launch_yaml`): the flags are those upstream's YAML reader rebuilds
from the YAML's ``gpt_args``, the files those name must be in the tree, a plugin flag must
follow the YAML on the command line (in the YAML it is not a route: the plugin activates
before the reader writes it), and upstream flags after the YAML are named, since the reader
drops them.
"""

from __future__ import annotations

import difflib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence, TextIO

from mindspeed_flow.config import flags_requested

from .errors import LaunchScriptError
from .launch_script import TrainingCommand, Word, read_training_command
from .launch_yaml import is_yaml_command, yaml_command
from .source_flags import FLAG_SOURCES, PLUGIN, FlagDecl, flag_catalogue, source_files

EXAMPLES = Path("scripts") / "mindspeed_mm"  # in a source checkout of the plugin
TREE_FILE_SUFFIXES = (".json", ".yaml", ".yml", ".py", ".sh")


@dataclass(frozen=True)
class Finding:
    """A problem at a script line: ``subject`` is the flag (or what else is wrong)."""

    line: int
    subject: str
    problem: str


@dataclass
class LaunchCheck:
    """The verdict on one script: findings (empty = passes), or why it was not checked."""

    script: Path
    findings: list[Finding] = field(default_factory=list)
    flags_by_owner: dict[str, int] = field(default_factory=dict)
    tree_files: list[str] = field(default_factory=list)
    not_checked: str | None = None

    @property
    def failed(self) -> bool:
        return bool(self.findings)

    def describe(self) -> str:
        if self.not_checked:
            return f"launch script {self.script}: not checked: {self.not_checked}"
        if self.findings:
            lines = [f"launch script {self.script}: {len(self.findings)} problem(s)"]
            return "\n".join(lines + [f"  {self.script}:{f.line}: {f.subject}: {f.problem}" for f in self.findings])
        owners = ", ".join(f"{owner} {count}" for owner, count in self.flags_by_owner.items())
        return (f"launch script {self.script}: ok: {sum(self.flags_by_owner.values())} flags known ({owners}); "
                f"files in the tree: {', '.join(self.tree_files)}")


def mindspeed_mm_root(roots: Sequence[Path]) -> Path | None:
    """The root that is a MindSpeed-MM tree (``pretrain_vlm.py`` beside ``mindspeed_mm/``)."""
    return next((Path(r) for r in roots if (Path(r) / "pretrain_vlm.py").is_file()
                 and (Path(r) / "mindspeed_mm").is_dir()), None)


def example_scripts() -> list[Path]:
    """The plugin's launch examples, when it is imported from a source checkout."""
    import mindspeed_flow

    checkout = Path(mindspeed_flow.__file__).resolve().parent.parent
    return sorted((checkout / EXAMPLES).glob("*.sh"))


def _is_flag(text: str) -> bool:
    return text.startswith("--") or (text.startswith("-") and text[1:2].isalpha())


def _arity_problem(nargs: int | str, given: int) -> str | None:
    if nargs in ("?", "*"):
        return None
    if nargs == "+":
        return None if given >= 1 else "takes one or more values, given none"
    if given == nargs:
        return None
    wanted = "no value" if nargs == 0 else f"{nargs} value(s)"
    return f"takes {wanted}, given {given}"


def check_flags(command: TrainingCommand, catalogue: dict[str, list[FlagDecl]]) -> tuple[list[Finding], dict[str, int]]:
    """Every flag known, with as many values as it takes; values never stand alone."""
    findings, owners = [], {owner: 0 for owner, _ in FLAG_SOURCES} | {PLUGIN: 0}
    args, i = command.args, 0
    while i < len(args):
        word = args[i]
        if not _is_flag(word.text):
            findings.append(Finding(word.line, repr(word.text), "a value with no flag before it "
                                    "(Megatron's parser rejects it as an unrecognized argument)"))
            i += 1
            continue
        name, inline = word.text.split("=", 1) if "=" in word.text else (word.text, None)
        values = [] if inline is None else [inline]
        i += 1
        while inline is None and i < len(args) and not _is_flag(args[i].text):
            values.append(args[i])
            i += 1
        decls = catalogue.get(name)
        if not decls:
            close = difflib.get_close_matches(name, catalogue, n=1, cutoff=0.8)
            findings.append(Finding(word.line, name, "no parser declares this flag (Megatron, MindSpeed, "
                                    "MindSpeed-MM, mindspeed-flow)" + (f"; did you mean {close[0]}?" if close else "")))
            continue
        owners[decls[0].owner] += 1
        arities = {d.nargs for d in decls}
        problem = _arity_problem(arities.pop(), len(values)) if len(arities) == 1 else None
        if problem:
            findings.append(Finding(word.line, name, f"{problem} ({decls[0].where})"))
    return findings, {owner: n for owner, n in owners.items() if n}


def _flag_values(args: list[Word]) -> list[tuple[str, Word]]:
    """(flag, value word) for each value that follows a flag."""
    pairs, flag = [], None
    for word in args:
        if _is_flag(word.text):
            flag, _, inline = word.text.partition("=")
            if inline:
                pairs.append((flag, Word(inline, word.line)))
        elif flag is not None:
            pairs.append((flag, word))
    return pairs


def check_tree_files(command: TrainingCommand, tree: Path) -> tuple[list[Finding], list[str]]:
    """The entry script and the example files the flags name inside the MindSpeed-MM tree."""
    findings, checked = [], []
    named = [("entry script", command.entry)] + [
        (flag, word) for flag, word in _flag_values(command.args)
        if word.text.endswith(TREE_FILE_SUFFIXES) and "$" not in word.text and not Path(word.text).is_absolute()]
    for subject, word in named:
        path = tree / word.text
        if not path.is_file():
            findings.append(Finding(word.line, subject, f"{word.text}: no such file in {tree}"))
            continue
        checked.append(word.text)
        if path.suffix == ".json":
            try:
                json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as err:
                findings.append(Finding(word.line, subject, f"{word.text}: not valid JSON ({err})"))
    return findings, checked


def check_launch_script(script: Path, roots: Sequence[Path],
                        catalogue: dict[str, list[FlagDecl]] | None = None) -> LaunchCheck:
    """The whole check of one script against the checkouts ``roots`` (``doctor --src`` roots)."""
    result = LaunchCheck(script)
    tree = mindspeed_mm_root(roots)
    files, missing = source_files(list(roots))
    if tree is None or missing:
        needs = (["MindSpeed-MM (pretrain_vlm.py, mindspeed_mm/)"] if tree is None else []) + [
            f"{owner} ({', '.join(patterns)})" for owner, patterns in FLAG_SOURCES if owner in missing]
        result.not_checked = f"no {'; no '.join(needs)} under --src"
        return result
    try:
        command = read_training_command(script)
    except LaunchScriptError as err:
        result.findings.append(Finding(err.line, "script", err.reason))
        return result
    except OSError as err:
        result.findings.append(Finding(0, "script", f"cannot be read ({err.strerror})"))
        return result
    catalogue = catalogue or flag_catalogue(files)
    plugin_args = command.args
    if is_yaml_command(command):
        findings, result.flags_by_owner, result.tree_files, plugin_args = check_yaml_command(command, tree, catalogue)
    else:
        flag_findings, result.flags_by_owner = check_flags(command, catalogue)
        file_findings, result.tree_files = check_tree_files(command, tree)
        findings = flag_findings + file_findings
    result.findings = sorted(findings, key=lambda f: f.line)
    if not flags_requested([w.text for w in plugin_args], environ={}):
        result.findings.append(Finding(command.entry.line, "plugin", "no plugin flag among the training "
                                       "arguments: add --use-flowtrain (or --flow-X)"))
    return result


def _is_plugin_flag(word: Word, catalogue: dict[str, list[FlagDecl]]) -> bool:
    return any(d.owner == PLUGIN for d in catalogue.get(word.text.split("=", 1)[0], ()))


def check_yaml_command(command: TrainingCommand, tree: Path, catalogue: dict[str, list[FlagDecl]]
                       ) -> tuple[list[Finding], dict[str, int], list[str], list[Word]]:
    """``pretrain_transformers.py CONFIG.yaml [plugin flags]``: findings, flags by owner, the tree
    files checked, and the plugin's words (those after the YAML)."""
    run = yaml_command(command, tree)
    if run.problem:
        return [Finding(run.config.line, "config", run.problem)], {}, [], run.after
    rebuilt = TrainingCommand(command.launcher, command.entry, run.rebuilt)
    findings, owners = check_flags(rebuilt, catalogue)
    findings = [Finding(f.line, f"{run.config.text}: gpt_args {f.subject}", f.problem) for f in findings]
    findings += [Finding(w.line, f"{run.config.text}: gpt_args {w.text}",
                         "a plugin flag in the YAML is not a route: the plugin activates before upstream's reader "
                         "writes it, and Megatron then refuses it; pass it after the YAML on the command line")
                 for w in run.rebuilt if _is_flag(w.text) and _is_plugin_flag(w, catalogue)]
    after_findings, after_owners = check_flags(TrainingCommand(command.launcher, command.entry, run.after), catalogue)
    findings += after_findings + [
        Finding(w.line, w.text, "dropped: upstream's YAML reader rebuilds the command line from the YAML alone "
                "(set it in the YAML's gpt_args)")
        for w in run.after if _is_flag(w.text) and w.text.split("=", 1)[0] in catalogue
        and not _is_plugin_flag(w, catalogue)]
    for owner, count in after_owners.items():
        owners[owner] = owners.get(owner, 0) + count
    file_findings, checked = check_tree_files(rebuilt, tree)
    return findings + file_findings, owners, list(dict.fromkeys([run.config.text] + checked)), run.after


def report_launch_scripts(roots: Sequence[Path], scripts: Sequence[Path], out: TextIO = sys.stdout) -> bool:
    """``doctor --src``'s part: check ``scripts`` (default: the plugin's examples); True if any failed.
    Without source roots there is nothing to check against (``doctor`` on the installed upstream)."""
    if not roots:
        return False
    scripts = list(scripts) or example_scripts()
    if not scripts:
        print(f"launch scripts: not checked: no {EXAMPLES} beside the installed package; name one with "
              "--launch-script", file=out)
        return False
    files, missing = source_files(list(roots))
    catalogue = None if missing else flag_catalogue(files)
    results = [check_launch_script(script, roots, catalogue) for script in scripts]
    print("\n".join(r.describe() for r in results), file=out)
    return any(r.failed for r in results)
