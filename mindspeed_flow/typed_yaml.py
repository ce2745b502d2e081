"""One reader from a YAML file to a (nested) frozen dataclass, by field names and type hints.

Why one: the job's config (``train/config.py``), the allocator's specs
(``allocator/specs.py``) and the schedule layout (``runtime/layout.py``) each walked
dataclass fields and checked YAML values their own way, and had drifted (one coerced
``trainable: "false"`` to ``True``, one took ``1e-3`` as a number and one did not).  Here the
walk is written once:

- every key must name a field (a typo is an error, not a silent default), every field
  without a default must be there, and every value must have the field's type;
- ``int``, ``bool`` and ``str`` are exact (``true`` is not an int, ``1`` is not a bool);
  ``float`` takes any number and numeric text (PyYAML reads ``1e-3`` as a string);
  ``Optional[X]`` takes ``null``; ``tuple[X, ...]`` and ``tuple[X, Y]`` take lists (the
  second of that length); a dataclass field takes a nested mapping;
- every refusal names the file and the dotted key (``data.capacity``, ``optim.betas[1]``)
  and is raised as the caller's exception class (each package keeps its own, all on
  :class:`~mindspeed_flow.errors.FlowError`); a refusal raised by the dataclass itself
  (``__post_init__``) gets the file and the key in front.

The sentences are the same for every reader (``unknown key data.capcity (known in data: ...)``,
``cluster.devices: expected int, got str 'eight'``), so a user meets one style of refusal
whichever file is wrong.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

from .errors import YamlReadError

T = TypeVar("T")
__all__ = ["YamlReadError", "build", "read_yaml"]


def _place(where: str) -> str:
    return where or "the top level"


def _wrong_type(key: str, expected: str, value: Any) -> str:
    return f"{key}: expected {expected}, got {type(value).__name__} {value!r}"


def child(where: str, name: str) -> str:
    """The dotted key of field ``name`` inside the mapping at ``where``."""
    return f"{where}.{name}" if where else name


def read_yaml(path: str | Path, *, error: type[Exception] = YamlReadError, what: str | None = None) -> Any:
    """The parsed YAML document at ``path`` (``None`` for an empty file).

    A file that cannot be read is refused as ``cannot read <what>``, one that does not parse
    as ``not valid YAML`` with the parser's line and column (after ``cannot read <what>:``
    when ``what`` is given), both naming the file."""
    import yaml

    path = Path(path)
    what_text = what or "the file"
    try:
        text = path.read_text()
    except OSError as exc:
        raise error(f"{path}: cannot read {what_text} ({exc.strerror or exc})") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        lead = f"cannot read {what}: " if what else ""
        raise error(f"{path}: {lead}not valid YAML: {exc}") from None


def build(cls: type[T], data: Any, *, path: str | Path, where: str = "", error: type[Exception] = YamlReadError) -> T:
    """An instance of dataclass ``cls`` from the mapping ``data`` read from ``path`` at key
    ``where``; unset fields keep their defaults.  Refusals are ``error(message)``."""
    return _Reader(Path(path), error).build(cls, data, where)


class _Reader:
    """One file's walk: which file the refusals name and which class they are raised as."""

    def __init__(self, path: Path, error: type[Exception]) -> None:
        self.path = path
        self.error = error

    def refuse(self, message: str) -> Exception:
        return self.error(f"{self.path}: {message}")

    def build(self, cls: type, data: Any, where: str) -> Any:
        if not isinstance(data, Mapping):
            raise self.refuse(f"{_place(where)}: expected a mapping, got {type(data).__name__} {data!r}")
        fields = dataclasses.fields(cls)
        known = [f.name for f in fields]
        unknown = sorted(str(key) for key in set(data) - set(known))
        if unknown:
            raise self.refuse(f"unknown key {child(where, unknown[0])} (known in {_place(where)}: {', '.join(known)})")
        missing = [f.name for f in fields if f.name not in data and f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING]
        if missing:
            raise self.refuse(f"missing key {child(where, missing[0])} (required in {_place(where)}: {', '.join(missing)})")
        hints = typing.get_type_hints(cls)
        values = {name: self.value(hints[name], value, child(where, name)) for name, value in data.items()}
        try:
            return cls(**values)
        except self.error as exc:  # the dataclass's own check (``__post_init__``)
            raise self.refuse(f"{_place(where)}: {exc}") from None

    def value(self, hint: Any, value: Any, key: str) -> Any:
        if dataclasses.is_dataclass(hint):
            return self.build(hint, value, key)
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            if value is None and type(None) in args:
                return None
            (hint,) = [a for a in args if a is not type(None)]  # Optional[X] only
            return self.value(hint, value, key)
        if origin is tuple:
            return self.tuple(args, value, key)
        if hint is Any:
            return value
        if hint is float:
            return self.number(value, key)
        if hint not in (int, bool, str):
            raise TypeError(f"typed_yaml cannot read a field of type {hint!r} ({key})")
        if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
            raise self.refuse(_wrong_type(key, hint.__name__, value))
        return value

    def tuple(self, args: tuple, value: Any, key: str) -> tuple:
        variadic = len(args) == 2 and args[1] is Ellipsis
        items = [args[0]] * len(value) if variadic and isinstance(value, (list, tuple)) else list(args)
        if not isinstance(value, (list, tuple)) or len(value) != len(items):
            numbers = all(a in (int, float) for a in items)
            expected = "a list" if variadic else f"a list of {len(items)} {'numbers' if numbers else 'values'}"
            raise self.refuse(_wrong_type(key, expected, value))
        return tuple(self.value(a, v, f"{key}[{i}]") for i, (a, v) in enumerate(zip(items, value)))

    def number(self, value: Any, key: str) -> float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as text
            try:
                return float(value)
            except ValueError:
                pass
        raise self.refuse(_wrong_type(key, "a number", value))
