"""The one YAML-to-dataclass reader: every refusal names the file and the dotted key, and is
raised as the caller's exception class (the job config, the allocator's specs and the
schedule layout read through it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest

from mindspeed_flow.errors import FlowError
from mindspeed_flow.typed_yaml import YamlReadError, build, read_yaml


class PlantedError(FlowError, ValueError):
    """A caller's own class."""


@dataclass(frozen=True)
class Inner:
    size: int
    scale: float = 1.0
    name: Optional[str] = None

    def __post_init__(self) -> None:
        if self.size < 0:
            raise PlantedError(f"size must be >= 0, got {self.size}")


@dataclass(frozen=True)
class Outer:
    inner: Inner
    flag: bool = False
    pair: tuple[float, float] = (0.0, 1.0)
    sizes: tuple[int, ...] = ()
    more: Inner = field(default_factory=lambda: Inner(size=0))


def read(tmp_path: Path, text: str, error: type[Exception] = YamlReadError) -> Outer:
    path = tmp_path / "file.yaml"
    path.write_text(text)
    return build(Outer, read_yaml(path, error=error), path=path, error=error)


def refusal(tmp_path: Path, text: str, error: type[Exception] = YamlReadError) -> str:
    with pytest.raises(error) as info:
        read(tmp_path, text, error)
    message = str(info.value)
    assert message.startswith(f"{tmp_path / 'file.yaml'}: "), message  # the file, always first
    return message


def test_nested_dataclasses_types_and_defaults(tmp_path):
    cfg = read(tmp_path, "inner: {size: 3, scale: 2, name: null}\npair: [1e-3, 2]\nsizes: [1, 2]\n")
    assert cfg == Outer(inner=Inner(size=3, scale=2.0), pair=(1e-3, 2.0), sizes=(1, 2))
    assert isinstance(cfg.inner.scale, float) and cfg.more == Inner(size=0) and cfg.flag is False


def test_unknown_key_names_file_and_key_path(tmp_path):
    message = refusal(tmp_path, "inner: {size: 1, sise: 2}\n")
    assert "unknown key inner.sise (known in inner: size, scale, name)" in message


def test_wrong_type_names_file_and_key_path(tmp_path):
    assert "inner.size: expected int, got str 'many'" in refusal(tmp_path, "inner: {size: many}\n")
    assert "flag: expected bool, got int 1" in refusal(tmp_path, "inner: {size: 1}\nflag: 1\n")
    assert "inner.size: expected int, got bool True" in refusal(tmp_path, "inner: {size: true}\n")
    assert "inner.scale: expected a number, got str 'big'" in refusal(tmp_path, "inner: {size: 1, scale: big}\n")
    assert "pair: expected a list of 2 numbers, got list [1]" in refusal(tmp_path, "inner: {size: 1}\npair: [1]\n")
    assert "sizes[1]: expected int, got float 2.5" in refusal(tmp_path, "inner: {size: 1}\nsizes: [1, 2.5]\n")
    assert "inner: expected a mapping, got int 3" in refusal(tmp_path, "inner: 3\n")


def test_missing_required_key_names_file_and_key_path(tmp_path):
    assert "missing key inner (required in the top level: inner)" in refusal(tmp_path, "flag: true\n")
    assert "missing key more.size (required in more: size)" in refusal(tmp_path, "inner: {size: 1}\nmore: {}\n")


def test_the_dataclass_own_refusal_gets_file_and_key_in_the_callers_class(tmp_path):
    message = refusal(tmp_path, "inner: {size: -1}\n", error=PlantedError)
    assert message.endswith("file.yaml: inner: size must be >= 0, got -1")
    assert issubclass(YamlReadError, FlowError) and issubclass(YamlReadError, ValueError)


def test_read_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("a: [1, 2\n")
    with pytest.raises(YamlReadError, match=r"(?s)broken\.yaml: not valid YAML: .*line 1, column 4"):
        read_yaml(path)
    with pytest.raises(YamlReadError, match=r"broken\.yaml: cannot read the layout: not valid YAML"):
        read_yaml(path, what="the layout")
    with pytest.raises(YamlReadError, match=r"absent\.yaml: cannot read the file"):
        read_yaml(tmp_path / "absent.yaml")
    path.write_text("")
    assert read_yaml(path) is None
