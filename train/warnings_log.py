"""Upstream noise, collected in every rank and reported once by the parent.

Four ranks importing megatron-core print "Apex is not installed" (and friends) four times
each; gloo and torch print their own lines to the process's file descriptors.  Each rank
runs under :func:`capture`: Python warnings and WARNING+ log records are counted by
message, and the rank's file descriptors 1 and 2 go to a file whose lines are counted
too.  The parent merges the ranks' :class:`Noise` and prints one line per distinct message
with its count (:func:`summary`); the terminal keeps only the progress bars and the report.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, TextIO

SHOWN_PER_KIND = 8  # distinct messages printed per kind; all of them go to the report


@dataclass
class Noise:
    """Counts of distinct messages: ``kind`` is ``warning`` (Python warnings, with their
    category and the file that raised them), ``log`` (logging records) or ``output``
    (lines written to stdout/stderr)."""

    counts: Counter = field(default_factory=Counter)  # (kind, message) -> count

    def add(self, kind: str, message: str, n: int = 1) -> None:
        message = message.strip()
        if message:
            self.counts[(kind, message)] += n

    def merge(self, other: "Noise") -> "Noise":
        self.counts.update(other.counts)
        return self

    def to_json(self) -> list[dict]:
        return [{"kind": k, "message": m, "count": c} for (k, m), c in self.counts.most_common()]

    @classmethod
    def from_json(cls, rows: list[dict]) -> "Noise":
        noise = cls()
        for row in rows:
            noise.add(row["kind"], row["message"], row["count"])
        return noise


class _CountingHandler(logging.Handler):
    def __init__(self, noise: Noise) -> None:
        super().__init__(logging.WARNING)
        self.noise = noise

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = record.getMessage()
        except Exception:  # noqa: BLE001 - a badly formatted record is still noise to count
            text = str(record.msg)
        self.noise.add("log", f"{record.levelname} {record.name}: {text}")


@dataclass
class Capture:
    """What :func:`capture` yields: the counts so far, and ``terminal``, a stream on the
    original stderr for whatever must still reach the user (a progress bar under torchrun)."""

    noise: Noise
    terminal: TextIO


@contextlib.contextmanager
def capture(redirect_fds: bool = True) -> Iterator[Capture]:
    """Count warnings, log records and (with ``redirect_fds``) every line written to file
    descriptors 1 and 2 while the block runs; everything is restored afterwards."""
    noise = Noise()
    handler = _CountingHandler(noise)
    root = logging.getLogger()
    saved_level, saved_handlers = root.level, list(root.handlers)
    saved_showwarning = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - warnings' signature
        noise.add("warning", f"{category.__name__}: {message} ({_short(filename)}:{lineno})")

    sink = tempfile.TemporaryFile(mode="w+b") if redirect_fds else None
    saved_fds = {}
    saved_streams = (sys.stdout, sys.stderr)
    terminal_fd = os.dup(2)
    terminal = io.TextIOWrapper(os.fdopen(terminal_fd, "wb", buffering=0), write_through=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = showwarning
            root.handlers = [handler]
            root.setLevel(min(saved_level or logging.WARNING, logging.WARNING))
            if sink is not None:
                for stream in saved_streams:
                    stream.flush()
                for fd in (1, 2):
                    saved_fds[fd] = os.dup(fd)
                    os.dup2(sink.fileno(), fd)
                # Python-level writers too, wherever sys.stdout/stderr pointed before
                sys.stdout = sys.stderr = open(sink.fileno(), "w", buffering=1, closefd=False)
            yield Capture(noise, terminal)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if sink is not None:
            sys.stdout, sys.stderr = saved_streams
        for fd, saved in saved_fds.items():
            os.dup2(saved, fd)
            os.close(saved)
        warnings.showwarning = saved_showwarning
        root.handlers, root.level = saved_handlers, saved_level
        if sink is not None:
            sink.seek(0)
            for line in sink.read().decode(errors="replace").splitlines():
                noise.add("output", line)
            sink.close()
        with contextlib.suppress(Exception):
            terminal.close()


def _short(filename: str) -> str:
    """``.../site-packages/megatron/core/x.py`` -> ``megatron/core/x.py``."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def summary(noise: Noise, ranks: int, shown: int = SHOWN_PER_KIND) -> str:
    """The lines the parent prints: one per distinct message (most frequent first), at most
    ``shown`` per kind, then how many more there were."""
    if not noise.counts:
        return f"upstream warnings: none from {ranks} ranks"
    total = sum(noise.counts.values())
    lines = [f"upstream warnings and log lines, collected from {ranks} ranks ({total} in all, "
             f"{len(noise.counts)} distinct; each printed once with its count):"]
    for kind in ("warning", "log", "output"):
        rows = [(m, c) for (k, m), c in noise.counts.most_common() if k == kind]
        for message, count in rows[:shown]:
            lines.append(f"  {count:4d}x [{kind}] {_one_line(message)}")
        if len(rows) > shown:
            lines.append(f"  ... and {len(rows) - shown} more distinct {kind} lines (see warnings.json in the report)")
    return "\n".join(lines)


def _one_line(message: str, width: int = 160) -> str:
    first = message.splitlines()[0] if message else ""
    return first if len(first) <= width else first[:width - 3] + "..."
