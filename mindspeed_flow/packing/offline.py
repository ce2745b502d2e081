"""``pack``: offline packing of a whole list of lengths."""

from __future__ import annotations

import logging
from typing import Any, Iterable

import numpy as np

from .bfd import best_fit_decreasing
from .ffd import first_fit_decreasing
from .lengths import as_length, length_array
from .overlong import Overlong, admit, check_policy
from .stats import PackStats

logger = logging.getLogger(__name__)


class Packs(list):
    """``list[list[int]]`` of item indices per pack, with the :class:`PackStats` of the run
    as ``.stats``."""

    stats: PackStats


def pack(lengths: Iterable[Any], capacity: int, overlong: Overlong = "error") -> Packs:
    """Pack items into packs of at most ``capacity`` tokens, offline (all lengths known).

    Returns the item indices (positions in ``lengths``) of each pack, packs in the order
    they were opened, items in placement order (longest first, ties by index).  The
    result is deterministic.

    Best-fit decreasing runs first.  When it uses more packs than the simple lower bound
    ``max(ceil(sum / C), #items > C/2)``, first-fit decreasing runs as well and the
    packing with fewer packs is kept (BFD on a tie): neither heuristic dominates the
    other, and this keeps the promise "never more packs than FFD" on every input.

    Items of length 0 and over ``capacity`` follow :func:`~.overlong.admit`; with
    ``overlong="split"`` an item index appears once per chunk, and its occurrences in pack
    order are its chunks in token order.  Anything not placed as it came is counted in
    ``.stats`` and logged.

    ``lengths`` is any iterable of integers (ints, numpy integers, 0-d integer tensors; a
    list, a generator, a 1-D integer array or tensor); a float, a boolean or a nested
    sequence is refused naming the first such item.  ``capacity`` may be a numpy or
    tensor integer too.
    """
    check_policy(overlong)
    capacity = as_length(capacity, "capacity")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    lengths = length_array(lengths)
    n = len(lengths)
    stats = PackStats(capacity=capacity, items=n)
    item_of, chunk_lengths = _admit_all(lengths, capacity, overlong, stats)

    order, bins = best_fit_decreasing(chunk_lengths, capacity)
    n_bins = int(bins.max()) + 1 if len(bins) else 0
    bound = max(-(-int(chunk_lengths.sum()) // capacity), int((2 * chunk_lengths > capacity).sum()))
    if n_bins > bound:
        ffd_order, ffd_bins = first_fit_decreasing(chunk_lengths, capacity)
        ffd_n = int(ffd_bins.max()) + 1
        if ffd_n < n_bins:
            order, bins, n_bins = ffd_order, ffd_bins, ffd_n

    stats.packs = n_bins
    stats.tokens = int(chunk_lengths.sum())
    packs = Packs(_group(item_of[order], bins, n_bins))
    packs.stats = stats
    if stats.altered:
        logger.warning("pack: %s", stats.summary())
    return packs


def _admit_all(
    lengths: np.ndarray, capacity: int, policy: Overlong, stats: PackStats
) -> tuple[np.ndarray, np.ndarray]:
    """Expand items into placeable chunks: ``(item index per chunk, chunk length)``.

    Only the few items that are zero or overlong go through the per-item rule; chunks of
    one item stay adjacent and in token order, so the stable sort in the packers keeps
    that order among equal lengths.
    """
    positions = np.arange(len(lengths), dtype=np.int64)
    special = np.flatnonzero((lengths <= 0) | (lengths > capacity))
    if not len(special):
        return positions, lengths
    chunks = [admit(int(i), int(lengths[i]), capacity, policy, stats) for i in special]
    per_item = np.ones(len(lengths), dtype=np.int64)
    per_item[special] = [len(c) for c in chunks]
    item_of = np.repeat(positions, per_item)
    chunk_lengths = np.repeat(lengths, per_item)
    first = np.cumsum(per_item) - per_item
    for i, c in zip(special.tolist(), chunks):
        chunk_lengths[first[i] : first[i] + len(c)] = c
    return item_of, chunk_lengths


def _group(items: np.ndarray, bins: np.ndarray, n_bins: int) -> list[list[int]]:
    """Items (in placement order) grouped by bin, bins in opening order."""
    by_bin = np.argsort(bins, kind="stable")
    flat = items[by_bin].tolist()
    ends = np.cumsum(np.bincount(bins, minlength=n_bins))
    starts = np.concatenate(([0], ends[:-1]))
    return list(map(flat.__getitem__, map(slice, starts.tolist(), ends.tolist())))
