"""Offline best-fit decreasing over integer lengths.

Sequential BFD takes items longest first and puts each into the open bin with the
smallest remaining space that fits.  Two facts let us place whole runs of equal-length
items at once, with exactly the result of the sequential loop:

1. Bins with the same remaining space are interchangeable for every later decision, so
   they are kept together in one FIFO bucket per remaining value (the FIFO order is the
   tie-break: among equally good bins the oldest wins, as a sequential loop with a queue
   per value would do).
2. When the best bin for length ``l`` has remaining ``r``, it still is the best bin after
   taking one item (``r - l`` is smaller than every other fitting value), so it takes
   ``q = r // l`` items in a row; the next ``t`` bins of the same bucket do the same.

The loop therefore runs once per (distinct length, bucket visited), not once per item;
each visit costs one O(log C) query of :class:`CapacityTree` and O(1) work per bin it
moves, in plain Python (see :class:`_Buckets` for why not numpy).
"""

from __future__ import annotations

from array import array
from itertools import repeat
from typing import Sequence

import numpy as np

from .segment_tree import CapacityTree


class _Buckets:
    """FIFO buckets of bin ids keyed by remaining space, plus the tree of non-empty keys.

    Plain Python lists, not numpy arrays: with many distinct lengths (heavy-tailed data)
    nearly every remaining space is its own bucket of a bin or two, and the numpy calls
    per bucket visit (about a microsecond of overhead each) cost more than the work.  A
    bucket is a list read from a head index, so taking and adding bins are slices and
    extends (C loops), not one Python step per bin.
    """

    def __init__(self, capacity: int) -> None:
        self.tree = CapacityTree(capacity)
        self.queues: dict[int, list[int]] = {}
        self.heads: dict[int, int] = {}  # first bin of each bucket not taken yet

    def push(self, remaining: int, bins: Sequence[int]) -> None:
        if remaining == 0 or not bins:  # full bins never take another item
            return
        queue = self.queues.get(remaining)
        if queue is None:
            self.queues[remaining] = list(bins)
            self.heads[remaining] = 0
            self.tree.add(remaining)
        else:
            queue.extend(bins)

    def pop(self, remaining: int, count: int) -> list[int]:
        """Take up to ``count`` of the oldest bins of a bucket."""
        queue, head = self.queues[remaining], self.heads[remaining]
        if head + count < len(queue):
            self.heads[remaining] = head + count
            return queue[head : head + count]
        del self.queues[remaining], self.heads[remaining]
        self.tree.remove(remaining)
        return queue[head:]


def decreasing_runs(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, list[int], list[int]]:
    """``(order, run_lengths, run_counts)``: item positions longest first (ties by
    position), then the distinct lengths in that order with how many items have each.
    Both decreasing packers walk these runs instead of single items."""
    # Stable sort on (capacity - length): a narrow unsigned key lets numpy use radix sort.
    key_type = np.uint16 if capacity < 2**16 else np.uint32
    order = np.argsort((capacity - lengths).astype(key_type), kind="stable")
    sorted_lengths = lengths[order]
    starts = np.flatnonzero(np.diff(sorted_lengths, prepend=-1))
    counts = np.diff(np.append(starts, len(lengths)))
    return order, sorted_lengths[starts].tolist(), counts.tolist()


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Best-fit decreasing of positive lengths ``<= capacity``.

    Returns ``(order, bins)``: ``order`` lists item positions longest first (ties by
    position), ``bins[k]`` is the bin of item ``order[k]``.  Bins are numbered in the
    order they were opened.
    """
    if len(lengths) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order, run_lengths, run_counts = decreasing_runs(lengths, capacity)
    buckets = _Buckets(capacity)
    # Placements in order: bin ``bins[k]`` takes ``takes[k]`` items of the current run
    # (int64 arrays that numpy reads without a copy).
    bins, takes = array("q"), array("q")
    next_bin = 0
    for length, count in zip(run_lengths, run_counts):
        while count:
            remaining = buckets.tree.successor(length)
            if remaining < 0:  # nothing fits: open as many bins as this run needs
                per_bin = capacity // length
                opened = -(-count // per_bin)
                taken: Sequence[int] = range(next_bin, next_bin + opened)
                next_bin += opened
                remaining = capacity
            else:
                per_bin = remaining // length
                taken = buckets.pop(remaining, -(-count // per_bin))
            placed = min(count, len(taken) * per_bin)
            full, last = divmod(placed, per_bin)
            bins.extend(taken[: full + (last > 0)])
            takes.extend(repeat(per_bin, full))
            if last:
                takes.append(last)
            buckets.push(remaining - per_bin * length, taken[:full])
            if last:  # the run ended inside this bin: it keeps room for shorter items
                buckets.push(remaining - last * length, taken[full : full + 1])
            count -= placed
    return order, np.frombuffer(bins, dtype=np.int64).repeat(np.frombuffer(takes, dtype=np.int64))
