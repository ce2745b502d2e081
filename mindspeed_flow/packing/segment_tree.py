"""A 64-way segment tree over the values ``0..capacity`` that answers "smallest present
value >= x".

The packers key open bins by their remaining capacity; best fit for an item of length
``l`` is the smallest remaining value ``>= l`` that some open bin has.  Each node of this
tree is one machine word (a Python int used as a 64-bit mask) whose bit ``j`` says
"child ``j`` holds at least one present value".  With fan-out 64 the depth is
``ceil(log64(C + 1))`` (2 levels for C = 8192), so ``add``, ``remove`` and ``successor``
are O(log C) with a constant of a few integer operations per level; this is what makes a
per-item Python loop affordable.
"""

from __future__ import annotations

from operator import index as as_int

_BITS = 64
_SHIFT = 6
_MASK = _BITS - 1


class CapacityTree:
    """Set of integers in ``[0, capacity]`` with O(log C) successor queries."""

    def __init__(self, capacity: int) -> None:
        capacity = as_int(capacity)  # numpy / tensor integers become ints: the masks need Python ints
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        levels: list[list[int]] = []
        size = capacity + 1
        while True:
            words = (size + _MASK) >> _SHIFT
            levels.append([0] * words)
            if words == 1:
                break
            size = words
        self._levels = levels

    def add(self, value: int) -> None:
        """Mark ``value`` present (idempotent)."""
        if type(value) is not int:
            value = as_int(value)
        for level in self._levels:
            word, bit = value >> _SHIFT, value & _MASK
            before = level[word]
            level[word] = before | (1 << bit)
            if before:  # the parents already know this subtree is non-empty
                return
            value = word

    def remove(self, value: int) -> None:
        """Mark ``value`` absent (idempotent)."""
        if type(value) is not int:
            value = as_int(value)
        for level in self._levels:
            word, bit = value >> _SHIFT, value & _MASK
            after = level[word] & ~(1 << bit)
            level[word] = after
            if after:  # the subtree still holds other values
                return
            value = word

    def __contains__(self, value: int) -> bool:
        if type(value) is not int:
            value = as_int(value)
        return bool((self._levels[0][value >> _SHIFT] >> (value & _MASK)) & 1)

    def successor(self, value: int) -> int:
        """Smallest present value ``>= value``, or -1 when there is none."""
        if type(value) is not int:
            value = as_int(value)
        levels = self._levels
        depth = len(levels)
        level = 0
        index = value
        while level < depth:
            words = levels[level]
            word = index >> _SHIFT
            if word >= len(words):
                return -1
            rest = words[word] >> (index & _MASK)
            if rest:
                index += (rest & -rest).bit_length() - 1
                # Walk down to the leftmost present leaf under the node just found.
                while level:
                    level -= 1
                    child = levels[level][index]
                    index = (index << _SHIFT) + (child & -child).bit_length() - 1
                return index
            index = word + 1  # first sibling subtree to the right, one level up
            level += 1
        return -1
