"""The on-disk line index of a JSON Lines shard, so a DP rank never scans the whole file.

Without it every rank would read every byte of every shard to find where the lines start.
The index holds, per non-blank line, its start and end byte offset and its 1-based line
number (numpy int64).  The first process that opens a shard builds it and saves it as
``<file>.flowidx`` next to the shard, or, when that directory is not writable, under
``$XDG_CACHE_HOME/mindspeed-flow/index/`` (default ``~/.cache``) keyed by the shard's
absolute path.  It is written to a temporary file and moved in place with ``os.replace``,
so concurrent builders each write a whole index and a reader never sees half of one.  It
records the shard's size and mtime; a shard that changed since makes it stale, and it is
rebuilt.  A rank that finds a valid index reads only it and the byte ranges of its records.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INDEX_SUFFIX = ".flowidx"
_FORMAT = 1  # first header word; bump when the layout changes
_HEADER = 4  # format, shard size, shard mtime_ns, record count


@dataclass(frozen=True)
class LineIndex:
    """Where the records of a JSON Lines shard are: ``[starts[i], ends[i])`` is record ``i``'s line."""

    starts: np.ndarray
    ends: np.ndarray
    lines: np.ndarray


def cache_dir() -> Path:
    """Where indexes go when a shard's own directory is read-only."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mindspeed-flow" / "index"


def index_paths(shard: Path) -> tuple[Path, Path]:
    """The sidecar ``<file>.flowidx`` and its fallback in :func:`cache_dir`."""
    shard = shard.absolute()
    key = hashlib.sha256(str(shard).encode()).hexdigest()[:24]
    return shard.with_name(shard.name + INDEX_SUFFIX), cache_dir() / f"{key}-{shard.name}{INDEX_SUFFIX}"


def load_or_build(shard: Path) -> LineIndex:
    """The index of ``shard``: loaded when a valid one is on disk, otherwise built and saved."""
    stat = os.stat(shard)
    header = np.array([_FORMAT, stat.st_size, stat.st_mtime_ns, 0], dtype=np.int64)
    candidates = index_paths(shard)
    for candidate in candidates:
        index = _load(candidate, header)
        if index is not None:
            return index
    index = build(shard)
    for candidate in candidates:
        if _save(candidate, header, index):
            break
    return index


def build(shard: Path) -> LineIndex:
    """Scan ``shard`` once for the byte range and line number of each non-blank line."""
    starts, ends, lines = [], [], []
    position = 0
    with open(shard, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                starts.append(position)
                ends.append(position + len(raw))
                lines.append(number)
            position += len(raw)
    return LineIndex(*(np.asarray(column, dtype=np.int64) for column in (starts, ends, lines)))


def _load(path: Path, header: np.ndarray) -> LineIndex | None:
    """The index saved at ``path`` if it describes the shard as ``header`` does, else None
    (missing, stale, or not a whole index file)."""
    try:
        with open(path, "rb") as f:
            data = np.load(f, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    if data.dtype != np.int64 or data.ndim != 1 or len(data) < _HEADER:
        return None
    count = int(data[3])
    if not np.array_equal(data[:3], header[:3]) or count < 0 or len(data) != _HEADER + 3 * count:
        return None
    starts, ends, lines = data[_HEADER:].reshape(3, count)
    return LineIndex(starts, ends, lines)


def _save(path: Path, header: np.ndarray, index: LineIndex) -> bool:
    """Write atomically (temporary file, then ``os.replace``); False where ``path`` is not writable."""
    data = np.concatenate([header[:3], [len(index.starts)], index.starts, index.ends, index.lines]).astype(np.int64)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, data, allow_pickle=False)
        os.replace(temporary, path)
    except OSError:
        Path(temporary).unlink(missing_ok=True)
        return False
    return True
