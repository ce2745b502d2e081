"""Bookkeeping of the torch_npu stand-in: which symbols are stood in, which were called.

The harness prints both lists at the end of every upstream run, so a reader sees exactly
what in that run was not the real upstream (only these) and which stand-in kernels the
run really went through.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable

STOOD_IN: list[str] = []
CALLS: Counter = Counter()


def stood_in(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare ``fn`` as the stand-in for the torch_npu symbol ``name``; count its calls."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            CALLS[name] += 1
            return fn(*args, **kwargs)

        STOOD_IN.append(name)
        return counted

    return decorate


def declare(*names: str) -> None:
    """Declare non-callable stood-in symbols (modules, constants, classes)."""
    STOOD_IN.extend(names)


def summary() -> dict[str, Any]:
    return {"stood_in": sorted(set(STOOD_IN)), "called": dict(sorted(CALLS.items()))}
