"""Integer lengths from whatever the caller holds: ints, numpy integers, 0-d integer tensors.

The loader hands the packers lengths taken from numpy arrays and tensors; those must work
exactly like Python ints.  Anything that is not an integer (a float, a bool, a nested
list, a string) is refused by name instead of being truncated or flattened quietly, since
a wrong length silently changes which samples share a pack.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable

import numpy as np

_BOOL_DTYPES = ("bool", "torch.bool")


def as_length(value: Any, what: str) -> int:
    """``value`` as a Python int (``operator.index``: int, numpy integer, 0-d integer
    tensor); ``TypeError`` naming ``what`` for anything else, booleans included."""
    if isinstance(value, (bool, np.bool_)) or str(getattr(value, "dtype", "")) in _BOOL_DTYPES:
        raise TypeError(f"{what} must be an integer, got the boolean {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer (int, numpy integer or 0-d integer tensor), "
                        f"got {value!r} of type {type(value).__name__}") from None


def length_array(lengths: Iterable[Any]) -> np.ndarray:
    """A 1-D int64 array of the lengths in ``lengths`` (any iterable of integers: a list, a
    generator, a 1-D integer numpy array or tensor).

    Refused, naming the first bad item (its index and value): floats (even integral ones:
    a float length is a bug upstream of the packer), booleans, nested sequences (2-D input
    is not flattened), anything else that is not an integer.
    """
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise TypeError(f"lengths must be an iterable of integers, got {type(lengths).__name__}")
    if hasattr(lengths, "__array__") and not isinstance(lengths, np.ndarray):
        lengths = np.asarray(lengths)  # a tensor: its numpy view, dtype and shape kept
    if isinstance(lengths, np.ndarray):
        if lengths.ndim != 1:
            first = f": item 0 is {lengths[0].tolist()!r}" if lengths.ndim > 1 and len(lengths) else ""
            raise ValueError(f"lengths must be flat (1-D), got an array of shape {lengths.shape}{first}")
        if lengths.dtype.kind in "iu":
            return lengths.astype(np.int64, copy=False)
        items = lengths.tolist() if lengths.dtype.kind != "O" else list(lengths)
    else:
        items = list(lengths)
        try:
            dense = np.asarray(items)
        except (ValueError, TypeError):  # ragged nesting: the loop below names the item
            dense = None
        if dense is not None and dense.ndim == 1 and dense.dtype.kind in "iu" and bool not in map(type, items):
            return dense.astype(np.int64, copy=False)
    out = np.empty(len(items), dtype=np.int64)
    for index, item in enumerate(items):
        if isinstance(item, (list, tuple, np.ndarray)) and np.ndim(item) > 0:
            raise ValueError(f"lengths must be flat: item {index} is the sequence {item!r}")
        out[index] = as_length(item, f"item {index}")
    return out
