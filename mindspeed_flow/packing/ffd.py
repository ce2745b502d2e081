"""Offline first-fit decreasing over integer lengths.

:func:`~mindspeed_flow.packing.pack` runs this next to best-fit decreasing because
neither dominates the other: for capacity 25 and lengths
``[24, 20, 18, 17, 11, 9, 7, 5, 4, 4, 3, 2]`` BFD needs 6 bins and FFD 5, while on other
inputs BFD wins.  Equal lengths are placed as a run: scanning bins in index order, each
bin with room ``r >= l`` takes ``r // l`` items, which is what the item-by-item loop does.
One pass per distinct length costs O(open bins) numpy work; bins that cannot take even
the shortest item are dropped from the scan as it goes.
"""

from __future__ import annotations

import numpy as np


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """First-fit decreasing of positive lengths ``<= capacity``; same return contract as
    :func:`~mindspeed_flow.packing.bfd.best_fit_decreasing`."""
    n = len(lengths)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    key_type = np.uint16 if capacity < 2**16 else np.uint32
    order = np.argsort((capacity - lengths).astype(key_type), kind="stable")
    sorted_lengths = lengths[order]
    starts = np.flatnonzero(np.diff(sorted_lengths, prepend=-1))
    counts = np.diff(np.append(starts, n))
    shortest = int(sorted_lengths[-1])

    ids = np.zeros(0, np.int64)  # open bins in index order ...
    room = np.zeros(0, np.int64)  # ... and their remaining space
    assigned: list[np.ndarray] = []
    next_bin = 0
    for run, (length, count) in enumerate(zip(sorted_lengths[starts].tolist(), counts.tolist())):
        fitting = np.flatnonzero(room >= length)
        if len(fitting):
            per_bin = room[fitting] // length
            reach = np.cumsum(per_bin)
            used = int(np.searchsorted(reach, count))  # the bin where the run ends, if any
            if used < len(fitting):
                fitting, per_bin = fitting[: used + 1], per_bin[: used + 1]
                per_bin[-1] -= int(reach[used]) - count
            assigned.append(np.repeat(ids[fitting], per_bin))
            room[fitting] -= per_bin * length
            count -= int(per_bin.sum())
        if count:  # no open bin has room left: open new ones at the end of the scan order
            per_bin = capacity // length
            opened = -(-count // per_bin)
            new = np.arange(next_bin, next_bin + opened, dtype=np.int64)
            next_bin += opened
            assigned.append(np.repeat(new, per_bin)[:count])
            new_room = np.full(opened, capacity - per_bin * length, dtype=np.int64)
            new_room[-1] = capacity - (count - (opened - 1) * per_bin) * length
            ids, room = np.concatenate([ids, new]), np.concatenate([room, new_room])
        if run % 64 == 63:
            alive = room >= shortest
            ids, room = ids[alive], room[alive]
    return order, np.concatenate(assigned)
