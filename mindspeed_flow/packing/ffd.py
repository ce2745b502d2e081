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
    # Items longer than C/2 come first and never share a bin (every open bin then has
    # less than C/2 left): each opens its own, all at once.
    big = next((k for k, length in enumerate(run_lengths) if 2 * length <= capacity), len(run_lengths))
    opened = sum(run_counts[:big])
    room[:opened] = capacity - np.repeat(run_lengths[:big], run_counts[:big])
    _refresh_blocks(room, block_room, 0, opened)
    assigned: list[np.ndarray] = [np.arange(opened, dtype=np.int64)]
    # numpy methods, not the np.* wrappers: with thousands of short runs (heavy-tailed
    # lengths) the per-call overhead is most of the time.
    for length, count in zip(run_lengths[big:], run_counts[big:]):
        for block in (block_room[: -(-opened // BLOCK)] >= length).nonzero()[0].tolist():
            start = block * BLOCK
            segment = room[start : start + BLOCK]
            fitting = (segment >= length).nonzero()[0]
            rooms = segment[fitting]
            per_bin = rooms // length
            reach = per_bin.cumsum()
            ends_here = int(reach[-1]) >= count
            if ends_here:  # the run ends in this block, in bin ``used``
                used = int(reach.searchsorted(count))
                fitting, rooms, per_bin = fitting[: used + 1], rooms[: used + 1], per_bin[: used + 1]
                per_bin[-1] -= int(reach[used]) - count
            assigned.append((fitting + start).repeat(per_bin))
            segment[fitting] = rooms - per_bin * length
            block_room[block] = segment.max()
            if ends_here:
                count = 0
                break
            count -= int(reach[-1])
        if count:  # nothing open has room: open new bins after the last one
            per_bin = capacity // length
            new = -(-count // per_bin)
            assigned.append(np.arange(opened, opened + new, dtype=np.int64).repeat(per_bin)[:count])
            room[opened : opened + new] = capacity - per_bin * length
            room[opened + new - 1] = capacity - (count - (new - 1) * per_bin) * length
            _refresh_blocks(room, block_room, opened, opened + new)
            opened += new
    return order, np.concatenate(assigned)


def _refresh_blocks(room: np.ndarray, block_room: np.ndarray, first_bin: int, end_bin: int) -> None:
    """Recompute the largest room of the blocks holding bins ``first_bin..end_bin - 1``."""
    first, last = first_bin // BLOCK, -(-end_bin // BLOCK)
    block_room[first:last] = room[first * BLOCK : last * BLOCK].reshape(-1, BLOCK).max(axis=1)
