"""The corpus: MindSpeed-MM's multimodal records, one file or a directory of shards.

A record is ``{"messages": [{"role": ..., "content": ...}, ...], "images": [path, ...]}``
(the layout of MindSpeed-MM's ``examples/qwen2.5vl`` data, ``<image>`` placeholders in the
contents).  A shard is a JSON Lines file (``.jsonl``, one record per line) or a JSON list
(``.json``).  Every record gets a global index (shards in sorted name order, records in
file order) and a place ``file:line`` (JSON Lines) or ``file[item]`` (JSON list) that
errors and logs name; the place is also the sample id.

Only the index is built when the corpus opens: the byte range of every non-blank line of
a JSON Lines shard (loaded from its on-disk index, :mod:`line_index`, once one process has
built it), the item count of a JSON list.  Records are read and parsed when a worker needs
them, so each DP rank reads only the bytes of its own records of a JSON Lines shard (a
JSON list file is read and parsed whole by each process that reads from it: prefer JSON
Lines for large corpora).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mindspeed_flow.data.errors import MalformedRecord
from mindspeed_flow.data.line_index import load_or_build

SHARD_SUFFIXES = (".jsonl", ".json")
DEMO_TOKENIZER_FILE = "flow_demo_tokenizer.json"  # never read as a shard


@dataclass
class Shard:
    path: Path
    offsets: np.ndarray | None  # byte offset per record (JSON Lines), None for a JSON list
    ends: np.ndarray | None  # byte offset just past each record's line (JSON Lines)
    lines: np.ndarray | None  # 1-based line number per record (JSON Lines)
    count: int

    def place(self, local: int) -> str:
        if self.lines is not None:
            return f"{self.path.name}:{int(self.lines[local])}"
        return f"{self.path.name}[{local}]"


@dataclass
class Corpus:
    """Random access to the records of one or more shards by global index."""

    root: Path
    shards: list[Shard]
    _starts: np.ndarray = field(init=False, repr=False)
    _json_cache: dict[int, list[Any]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self._starts = np.cumsum([0] + [s.count for s in self.shards])

    @classmethod
    def open(cls, source: str | os.PathLike) -> "Corpus":
        """Index a ``.jsonl``/``.json`` file or a directory of them (not recursive)."""
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.iterdir()
                           if p.suffix in SHARD_SUFFIXES and p.name != DEMO_TOKENIZER_FILE and p.is_file())
            if not files:
                raise FileNotFoundError(f"{path}: no {'/'.join(SHARD_SUFFIXES)} shards in this directory")
            root = path
        elif path.is_file():
            if path.suffix not in SHARD_SUFFIXES:
                raise ValueError(f"{path}: a source must be a .jsonl or .json file or a directory of them")
            files, root = [path], path.parent
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
        return cls(root, [_index(f) for f in files])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def locate(self, index: int) -> tuple[Shard, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} out of range (corpus has {len(self)})")
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self.shards[shard], index - int(self._starts[shard])

    def place(self, index: int) -> str:
        """``file:line`` or ``file[item]`` of record ``index``: its sample id."""
        shard, local = self.locate(index)
        return shard.place(local)

    def read(self, index: int) -> dict[str, Any]:
        """The record at ``index``; :class:`MalformedRecord` names the place when it is not
        a JSON object."""
        shard, local = self.locate(index)
        if shard.offsets is None:
            record = self._json_list(shard)[local]
        else:
            start, end = int(shard.offsets[local]), int(shard.ends[local])
            with open(shard.path, "rb", buffering=0) as f:  # unbuffered: no bytes beyond this record
                f.seek(start)
                raw = f.read(end - start)
            record = _parse(raw, shard.place(local), dict, "a record")
        if not isinstance(record, dict):
            raise MalformedRecord(shard.place(local), f"a record must be a JSON object, got {type(record).__name__}")
        return record

    def _json_list(self, shard: Shard) -> list[Any]:
        key = self.shards.index(shard)
        if key not in self._json_cache:
            self._json_cache = {key: _load_json_list(shard.path)}  # keep one parsed list at a time
        return self._json_cache[key]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_json_cache"] = {}  # workers parse what they read
        return state


def _parse(raw: bytes, place: str, expected: type, what: str) -> Any:
    """``raw`` as JSON of type ``expected``; :class:`MalformedRecord` naming ``place`` otherwise."""
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise MalformedRecord(place, f"malformed JSON ({e})") from None
    if not isinstance(value, expected):
        kind = "object" if expected is dict else expected.__name__
        raise MalformedRecord(place, f"{what} must be a JSON {kind}, got {type(value).__name__}")
    return value


def _load_json_list(path: Path) -> list[Any]:
    return _parse(path.read_bytes(), path.name, list, "a .json shard")


def _index(path: Path) -> Shard:
    if path.suffix == ".json":
        return Shard(path, None, None, None, len(_load_json_list(path)))
    index = load_or_build(path)
    return Shard(path, index.starts, index.ends, index.lines, len(index.starts))
