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
each visit costs one O(log C) query of :class:`CapacityTree` and a few numpy calls.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from .segment_tree import CapacityTree


class _Buckets:
    """FIFO buckets of bin ids keyed by remaining space, plus the tree of non-empty keys."""

    def __init__(self, capacity: int) -> None:
        self.tree = CapacityTree(capacity)
        self.queues: dict[int, deque[np.ndarray]] = {}
        self.sizes: dict[int, int] = {}

    def push(self, remaining: int, bins: np.ndarray) -> None:
        if remaining == 0 or not len(bins):  # full bins never take another item
            return
        queue = self.queues.get(remaining)
        if queue is None:
            self.queues[remaining] = deque([bins])
            self.sizes[remaining] = len(bins)
            self.tree.add(remaining)
        else:
            queue.append(bins)
            self.sizes[remaining] += len(bins)

    def pop(self, remaining: int, count: int) -> np.ndarray:
        """Take the ``count`` oldest bins of a bucket (``count`` <= its size)."""
        queue = self.queues[remaining]
        taken = []
        while count:
            head = queue[0]
            if len(head) <= count:
                taken.append(queue.popleft())
                count -= len(head)
            else:
                taken.append(head[:count])
                queue[0] = head[count:]
                count = 0
        size = self.sizes[remaining] - sum(len(t) for t in taken)
        if size:
            self.sizes[remaining] = size
        else:
            del self.queues[remaining], self.sizes[remaining]
            self.tree.remove(remaining)
        return taken[0] if len(taken) == 1 else np.concatenate(taken)


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
    assigned: list[np.ndarray] = []
    next_bin = 0
    for length, count in zip(run_lengths, run_counts):
        while count:
            remaining = buckets.tree.successor(length)
            if remaining < 0:  # nothing fits: open as many bins as this run needs
                per_bin = capacity // length
                opened = -(-count // per_bin)
                bins = np.arange(next_bin, next_bin + opened, dtype=np.int64)
                next_bin += opened
                remaining, per_bin_avail = capacity, per_bin
                taken = bins
            else:
                per_bin_avail = remaining // length
                needed = -(-count // per_bin_avail)
                taken = buckets.pop(remaining, min(buckets.sizes[remaining], needed))
            placed = min(count, len(taken) * per_bin_avail)
            assigned.append(np.repeat(taken, per_bin_avail)[:placed])
            full, last = divmod(placed, per_bin_avail)
            buckets.push(remaining - per_bin_avail * length, taken[:full])
            if last:  # the run ended inside this bin: it keeps room for shorter items
                buckets.push(remaining - last * length, taken[full:])
            count -= placed
    return order, np.concatenate(assigned)
