"""Profile and plan files: YAML or JSON by suffix, and dataclass fields read with errors
that name the file and the place."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Mapping

from ..typed_yaml import read_yaml
from .errors import AllocatorError


def write_data(path: str | Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as JSON (``.json``) or YAML (``.yaml``/``.yml``)."""
    path = Path(path)
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise AllocatorError(f"{path}: files are .yaml, .yml or .json")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".json":
        path.write_text(json.dumps(data, indent=1) + "\n")
    else:
        import yaml

        path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def read_data(path: str | Path) -> Any:
    """The parsed contents of a JSON (``.json``) or YAML file; a file that does not parse
    is named with the parser's line and column."""
    path = Path(path)
    if not path.is_file():
        raise AllocatorError(f"{path} does not exist")
    if path.suffix != ".json":
        return read_yaml(path, error=AllocatorError)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AllocatorError(f"{path}: not valid JSON: {exc}") from None


def field_values(cls: type, data: Any, where: str) -> dict[str, Any]:
    """The values of the fields of dataclass ``cls`` in mapping ``data``; a field without
    a default must be there."""
    if not isinstance(data, Mapping):
        raise AllocatorError(f"{where}: expected a mapping")
    names = [f.name for f in fields(cls) if f.name in data or (f.default is MISSING and f.default_factory is MISSING)]
    missing = [n for n in names if n not in data]
    if missing:
        raise AllocatorError(f"{where}: missing {', '.join(missing)}")
    return {n: data[n] for n in names}
