"""The one base of every exception the plugin raises on purpose.

Each package keeps its own exceptions in its ``errors`` module (``allocator.errors``,
``schedule.errors``, ``pool.errors``, ...) and every one of them derives from
:class:`FlowError`, so a caller (a launcher, ``doctor``, a test) can tell "the plugin refused
or failed, with a message that names the cause" from an accident inside torch or upstream
with one ``except FlowError``.  The classes keep the builtin base they always had
(``ValueError``, ``RuntimeError``, ...) beside it: code that catches those still does.

This module imports nothing of the project, so any module may import it.  It also holds the
exceptions of the package's top-level modules (``spawn``), which have no package of their own.
"""

from __future__ import annotations


class FlowError(Exception):
    """Raised by mindspeed-flow itself: the message names what is wrong and where."""


class RankFailed(FlowError, RuntimeError):
    """A rank raised, died or ran past the time limit; the message holds its traceback."""


class YamlReadError(FlowError, ValueError):
    """A YAML file that does not match its dataclass (:mod:`mindspeed_flow.typed_yaml`'s
    default; each reader passes its own package's class)."""
