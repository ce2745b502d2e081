"""Profile and plan files: YAML or JSON by suffix, and dataclass fields read with errors
that name the file and the place."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any, Mapping

from .specs import AllocatorError


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
    path = Path(path)
    if not path.is_file():
        raise AllocatorError(f"{path} does not exist")
    text = path.read_text()
    if path.suffix == ".json":
        return json.loads(text)
    import yaml

    return yaml.safe_load(text)


def field_values(cls: type, data: Any, where: str) -> dict[str, Any]:
    """The values of every field of dataclass ``cls`` from mapping ``data``."""
    if not isinstance(data, Mapping):
        raise AllocatorError(f"{where}: expected a mapping")
    names = [f.name for f in fields(cls)]
    missing = [n for n in names if n not in data]
    if missing:
        raise AllocatorError(f"{where}: missing {', '.join(missing)}")
    return {n: data[n] for n in names}
