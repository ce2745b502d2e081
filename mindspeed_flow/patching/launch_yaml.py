"""The command line a YAML-driven MindSpeed-MM launch really runs with.

``pretrain_transformers.py CONFIG.yaml`` (the Qwen3-VL / Qwen3.5 recipes) does not parse the
words after it: before anything parses, ``mindspeed_mm/configs/read_yaml_config.py`` rebuilds
``sys.argv`` from the YAML alone - one ``--key`` per leaf of ``gpt_args`` (and ``lora_args``),
``_`` turned into ``-``, a ``true`` as a bare switch, a list as the flag repeated, anything else
(``false`` too) as ``--key VALUE`` - then ``--mm-data`` / ``--mm-model`` (the YAML) and
``--mm-tool`` (its ``MM_TOOL_PATH``).  Upstream's own flags after the YAML are dropped (its
example's ``--distributed-backend nccl`` too); the plugin's flags there still act, because
the plugin reads them at activation, before the reader runs.

:func:`yaml_command` gives the words that reach Megatron's parser, each at the script line of
the YAML argument, and what the reader would drop, for
:func:`~mindspeed_flow.patching.launch_check.check_launch_script`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .launch_script import TrainingCommand, Word

READER_SECTIONS = ("gpt_args", "lora_args")  # the YAML sections the reader turns into flags


@dataclass
class YamlCommand:
    """A YAML-driven training command: the YAML, the rebuilt arguments, the words after the YAML."""

    config: Word                                   # the YAML argument, as written in the script
    rebuilt: list[Word] = field(default_factory=list)  # what the reader puts in sys.argv
    after: list[Word] = field(default_factory=list)    # the script's words after the YAML
    problem: str | None = None                     # why the YAML could not be read (None: it was)


def is_yaml_command(command: TrainingCommand) -> bool:
    """The entry's first argument is a YAML file, as upstream's reader recognises it."""
    return bool(command.args) and command.args[0].text.endswith(".yaml")


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    """The reader's flattening: every non-dict leaf at any depth, by its own key."""
    out: list[tuple[str, Any]] = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            out += _leaves(value) if isinstance(value, dict) else [(str(key), value)]
    return out


def rebuilt_arguments(config: dict, path_text: str, line: int) -> list[Word]:
    """The words upstream's reader writes into ``sys.argv`` (after the script name) for ``config``."""
    flat: dict[str, Any] = {}
    for section in READER_SECTIONS:
        flat.update((key.replace("_", "-"), value) for key, value in _leaves(config.get(section) or {}))
    words: list[str] = []
    for key, value in flat.items():
        if value is True:
            words.append(f"--{key}")
        elif isinstance(value, list):
            for item in value:
                words += [f"--{key}", str(item)]
        else:
            words += [f"--{key}", str(value)]
    words += ["--mm-data", path_text, "--mm-model", path_text, "--mm-tool", str(config.get("MM_TOOL_PATH"))]
    return [Word(text, line) for text in words]


def yaml_command(command: TrainingCommand, tree: Path) -> YamlCommand:
    """Read the YAML ``command`` names (relative to the MindSpeed-MM ``tree``, where upstream's
    scripts run) and rebuild its arguments; ``problem`` says why not when it cannot."""
    import yaml

    config_word = command.args[0]
    result = YamlCommand(config_word, after=list(command.args[1:]))
    path = Path(config_word.text) if Path(config_word.text).is_absolute() else tree / config_word.text
    if "$" in config_word.text:
        result.problem = f"{config_word.text}: not expanded (set by a command the check does not run)"
        return result
    try:
        config = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        result.problem = f"{config_word.text}: no such file in {tree}"
        return result
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        result.problem = f"{config_word.text}: not readable YAML ({err})"
        return result
    missing = [key for key in ("gpt_args", "MM_TOOL_PATH") if not isinstance(config, dict) or key not in config]
    if missing:
        result.problem = f"{config_word.text}: no {' and no '.join(missing)} (upstream's YAML reader requires them)"
        return result
    result.rebuilt = rebuilt_arguments(config, config_word.text, config_word.line)
    return result
