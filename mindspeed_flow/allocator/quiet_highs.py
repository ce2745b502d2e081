"""A HiGHS instance that prints nothing unless asked.

``output_flag=False`` silences HiGHS's solve log, but not its banner (``Running HiGHS
1.16.0 ... Copyright ...``, two lines on stdout, once per process): highspy 1.16's
``Highs.__init__`` enables its callbacks, which logs the header before any option can be
set (ERGO-Code/HiGHS#1702, #2749).  So while the instance is constructed, file descriptor
1 points at a scratch file (Python's and C's stdout buffers flushed before and after, so
nothing else is caught or reordered), then the log options are switched off.  Another
thread writing to stdout during those microseconds would lose its text: the allocator
builds its models from one thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
from typing import Iterator

import highspy


def _flush_c_stdout() -> None:
    """Flush C's stdio buffers (HiGHS prints through them), where libc can be loaded."""
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError, TypeError):  # no libc to load by that name (not Linux/macOS)
        pass


@contextlib.contextmanager
def _stdout_fd_discarded() -> Iterator[None]:
    """File descriptor 1 redirected to a scratch file inside the block (nothing to redirect
    when it is closed)."""
    if sys.stdout is not None:
        sys.stdout.flush()
    _flush_c_stdout()
    try:
        saved = os.dup(1)
    except OSError:
        yield
        return
    try:
        with tempfile.TemporaryFile() as scratch:
            os.dup2(scratch.fileno(), 1)
            try:
                yield
            finally:
                _flush_c_stdout()
                os.dup2(saved, 1)
    finally:
        os.close(saved)


def new_highs(verbose: bool = False) -> highspy.Highs:
    """``highspy.Highs()``; unless ``verbose``, its banner is discarded and its log is off
    (``output_flag``, ``log_to_console``)."""
    if verbose:
        return highspy.Highs()
    with _stdout_fd_discarded():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("log_to_console", False)
    return h
