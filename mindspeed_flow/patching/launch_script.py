"""Read a MindSpeed-MM launch script's training command without running it.

Launch scripts (``examples/qwen2.5vl/finetune_qwen2_5_vl_7b.sh`` and the plugin's copy in
``scripts/mindspeed_mm/``) build the command line from shell variables
(``GPT_ARGS="..."``, ``$MM_ARGS``) and then run ``torchrun ... pretrain_vlm.py $GPT_ARGS ...``.
Running the script to see its arguments would source Ascend's toolkit, make folders and
start training, so this reads the small part of bash such scripts use: assignments (also
``export``), ``$NAME`` / ``${NAME}`` expansion, quotes, backslash continuations, comments,
pipes and redirections.  ``$(...)``, ``$((...))`` and backquotes are kept as text (their values never
matter for which flags are passed).  Every word keeps the script line it came from, so a
finding names the line to edit: for ``$GPT_ARGS`` that is the line inside ``GPT_ARGS="..."``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import LaunchScriptError

OPERATORS = ("&&", "||", ";;", ">&", ">>", "|", "&", ";", ">", "<")
REDIRECTIONS = (">&", ">>", ">", "<")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=")
LAUNCHERS = ("torchrun", "python", "python3")  # what starts a training command


@dataclass(frozen=True)
class Word:
    """One shell word after expansion, with the script line its first character came from."""

    text: str
    line: int


@dataclass(frozen=True)
class TrainingCommand:
    """The command that starts training: what runs it, the entry script, and its arguments."""

    launcher: list[Word]  # e.g. torchrun $DISTRIBUTED_ARGS -m mindspeed_flow.launch
    entry: Word           # e.g. pretrain_vlm.py
    args: list[Word]      # the training script's arguments, in order


Chars = list[tuple[str, int]]  # a word in the making: each character with its line


class _Reader:
    """Turns the script into commands (lists of words), expanding variables as bash would."""

    def __init__(self, text: str, path: Path):
        self.text, self.path, self.pos, self.line = text, path, 0, 1
        self.variables: dict[str, Chars] = {}

    def error(self, reason: str, line: int | None = None) -> LaunchScriptError:
        return LaunchScriptError(self.path, line or self.line, reason)

    def peek(self, ahead: int = 0) -> str:
        index = self.pos + ahead
        return self.text[index] if index < len(self.text) else ""

    def take(self) -> str:
        char = self.text[self.pos]
        self.pos += 1
        if char == "\n":
            self.line += 1
        return char

    def commands(self):
        """Yield each simple command: its words as ``(characters, quoted)``, before field splitting."""
        words: list[tuple[Chars, bool]] = []
        while self.pos < len(self.text):
            char = self.peek()
            if char == "\\" and self.peek(1) == "\n":
                self.take(), self.take()
            elif char in " \t":
                self.take()
            elif char == "#":
                while self.peek() not in ("\n", ""):
                    self.take()
            elif char == "\n" or any(self.text.startswith(op, self.pos) for op in OPERATORS):
                operator = next((op for op in OPERATORS if self.text.startswith(op, self.pos)), "\n")
                for _ in operator:
                    self.take()
                if operator in REDIRECTIONS:
                    while self.peek() in (" ", "\t"):
                        self.take()
                    self.word()  # the redirection's target is not an argument
                    continue
                if words:
                    yield words
                words = []
            else:
                words.append(self.word())
        if words:
            yield words

    def word(self) -> tuple[Chars, bool]:
        """One word: characters up to unquoted blank or operator; ``quoted`` if any part was."""
        chars: Chars = []
        quoted = False
        while self.pos < len(self.text):
            char = self.peek()
            if char in " \t\n" or any(self.text.startswith(op, self.pos) for op in OPERATORS):
                break
            if char == "\\":
                self.take()
                if self.peek() == "\n":  # a line continuation inside a word joins it
                    self.take()
                    continue
                line = self.line
                chars.append((self.take(), line))
            elif char == "'":
                quoted = True
                start = self.line
                self.take()
                while self.peek() != "'":
                    if not self.peek():
                        raise self.error("unterminated single quote", start)
                    line = self.line
                    chars.append((self.take(), line))
                self.take()
            elif char == '"':
                quoted = True
                chars += self.double_quoted()
            elif char == "$":
                chars += self.expansion()
            elif char == "`":
                chars += self.backquoted()
            else:
                line = self.line
                chars.append((self.take(), line))
        if chars and chars[-1][0].isdigit() and self.peek() in (">", "<") and all(c.isdigit() for c, _ in chars):
            return [], False  # a file descriptor number (2>&1): not a word
        return chars, quoted

    def double_quoted(self) -> Chars:
        start = self.line
        self.take()
        chars: Chars = []
        while self.peek() != '"':
            char = self.peek()
            if not char:
                raise self.error("unterminated double quote", start)
            if char == "\\" and self.peek(1) == "\n":
                self.take(), self.take()
            elif char == "\\" and self.peek(1) in '"\\$`':
                self.take()
                line = self.line
                chars.append((self.take(), line))
            elif char == "$":
                chars += self.expansion()
            else:
                line = self.line
                chars.append((self.take(), line))
        self.take()
        return chars

    def as_written(self, start: int, line: int) -> Chars:
        """The script's text from ``start`` to here, unexpanded (an opaque part of a word)."""
        return [(c, line) for c in self.text[start:self.pos]]

    def written_through(self, closer: str, start: int, line: int, opener: str) -> Chars:
        """Skip past the next ``closer``; the text from ``start`` as written."""
        while self.peek() != closer:
            if not self.peek():
                raise self.error(f"unterminated {opener}", line)
            self.take()
        self.take()
        return self.as_written(start, line)

    def backquoted(self) -> Chars:
        """```command``` substitution, kept as written."""
        line, start = self.line, self.pos
        self.take()
        return self.written_through("`", start, line, "`")

    def expansion(self) -> Chars:
        """``$NAME`` / ``${NAME}`` / ``${NAME:-default}``: the variable's characters (with their
        own lines); unknown variables, other ``${...}`` forms, ``$(...)`` and ``$((...))`` stay
        as written."""
        line = self.line
        if self.peek(1) == "(":
            depth, start = 0, self.pos
            while True:
                char = self.peek()
                if not char:
                    raise self.error("unterminated $(", line)
                depth += (char == "(") - (char == ")")
                self.take()
                if char == ")" and depth == 0:
                    break
            return self.as_written(start, line)
        start = self.pos
        self.take()
        braced = self.peek() == "{"
        if braced:
            self.take()
        match = NAME.match(self.text, self.pos)
        if match is None:
            return [("$", line)] + ([("{", line)] if braced else [])
        for _ in match.group():
            self.take()
        default: Chars | None = None
        if braced and self.text.startswith(":-", self.pos):  # ${NAME:-default}
            self.take(), self.take()
            default = []
            while self.peek() not in ("}", "\n", ""):
                default.append((self.take(), line))
        if braced and self.peek() != "}":  # another ${NAME...} form: kept as written
            return self.written_through("}", start, line, "${")
        if braced:
            self.take()
        written = f"${{{match.group()}}}" if braced else f"${match.group()}"
        value = self.variables.get(match.group())
        if not value and default is not None:
            return default
        return [(c, line) for c in written] if value is None else value


def _split(chars: Chars, quoted: bool) -> list[Word]:
    """Field splitting of an unquoted expansion: ``$GPT_ARGS`` becomes one word per flag."""
    if quoted:
        return [Word("".join(c for c, _ in chars), chars[0][1])] if chars else []
    words, current = [], []
    for char, line in chars + [(" ", 0)]:
        if char in " \t\n":
            if current:
                words.append(Word("".join(c for c, _ in current), current[0][1]))
            current = []
        else:
            current.append((char, line))
    return words


def read_training_command(path: Path, text: str | None = None) -> TrainingCommand:
    """The first command of the script that starts a Python entry script (a word ending in
    ``.py``) with one of :data:`LAUNCHERS`."""
    reader = _Reader(path.read_text() if text is None else text, path)
    for raw in reader.commands():
        raw = [(chars, quoted) for chars, quoted in raw if chars or quoted]
        if raw and raw[0][0] and "".join(c for c, _ in raw[0][0]) == "export":
            raw = raw[1:]
        assignments = [ASSIGNMENT.match("".join(c for c, _ in chars)) for chars, _ in raw]
        if raw and all(assignments):
            for (chars, _), match in zip(raw, assignments):
                reader.variables[match.group(1)] = chars[match.end():]
            continue
        words = [word for chars, quoted in raw for word in _split(chars, quoted)]
        if not words or Path(words[0].text).name not in LAUNCHERS:
            continue
        entry = next((i for i, w in enumerate(words) if w.text.endswith(".py")), None)
        if entry is not None:
            return TrainingCommand(words[:entry], words[entry], words[entry + 1:])
    raise LaunchScriptError(path, reader.line, f"no training command ({' / '.join(LAUNCHERS)} running "
                            "a .py entry script) found")
