"""Offline first-fit decreasing over integer lengths.

:func:`~mindspeed_flow.packing.pack` runs this next to best-fit decreasing because
neither dominates the other: for capacity 25 and lengths
``[24, 20, 18, 17, 11, 9, 7, 5, 4, 4, 3, 2]`` BFD needs 6 bins and FFD 5, while on other
inputs BFD wins.

Equal lengths are placed as a run: scanning bins in index order, each bin with room
``r >= l`` takes ``r // l`` items, which is exactly what the item-by-item loop does.  The
scan is two-level: bins sit in blocks of 1024 with the largest room of each block kept
up to date, so a run looks only inside blocks that can take its length, in block order,
and stops as soon as the run is placed.
"""

from __future__ import annotations

import numpy as np

from .bfd import decreasing_runs

BLOCK = 1024


def first_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """First-fit decreasing of positive lengths ``<= capacity``; same return contract as
    :func:`~mindspeed_flow.packing.bfd.best_fit_decreasing`."""
    n = len(lengths)
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order, run_lengths, run_counts = decreasing_runs(lengths, capacity)
    blocks = -(-n // BLOCK)  # never more bins than items
    room = np.full(blocks * BLOCK, -1, dtype=np.int64)  # -1: bin not opened yet
    block_room = np.full(blocks, -1, dtype=np.int64)  # largest room in each block
    assigned: list[np.ndarray] = []
    opened = 0
    for length, count in zip(run_lengths, run_counts):
        for block in np.flatnonzero(block_room[: -(-opened // BLOCK)] >= length).tolist():
            segment = room[block * BLOCK : (block + 1) * BLOCK]
            fitting = np.flatnonzero(segment >= length)
            per_bin = segment[fitting] // length
            reach = np.cumsum(per_bin)
            used = int(np.searchsorted(reach, count))  # the bin where the run ends, if here
            if used < len(fitting):
                fitting, per_bin = fitting[: used + 1], per_bin[: used + 1]
                per_bin[-1] -= int(reach[used]) - count
            assigned.append(np.repeat(fitting + block * BLOCK, per_bin))
            segment[fitting] -= per_bin * length
            block_room[block] = segment.max()
            count -= int(per_bin.sum())
            if not count:
                break
        if count:  # nothing open has room: open new bins after the last one
            per_bin = capacity // length
            new = -(-count // per_bin)
            assigned.append(np.repeat(np.arange(opened, opened + new, dtype=np.int64), per_bin)[:count])
            room[opened : opened + new] = capacity - per_bin * length
            room[opened + new - 1] = capacity - (count - (new - 1) * per_bin) * length
            first, last = opened // BLOCK, -(-(opened + new) // BLOCK)
            block_room[first:last] = room[first * BLOCK : last * BLOCK].reshape(-1, BLOCK).max(axis=1)
            opened += new
    return order, np.concatenate(assigned)
