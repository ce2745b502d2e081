"""Which records a DP rank reads in an epoch.

The epoch's order is a permutation of all record indices drawn from ``(seed, epoch)``;
rank ``r`` of ``d`` takes every ``d``-th entry starting at ``r``.  The slices are disjoint
and together hold every record once, for any ``d`` (rank counts differ by at most one).
Every rank computes the same permutation without communication.
"""

from __future__ import annotations

import numpy as np


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Record indices in the order epoch ``epoch`` visits them (all ranks together)."""
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.Generator(np.random.PCG64([seed, epoch])).permutation(n).astype(np.int64)


def check_rank(dp_rank: int, dp_size: int) -> None:
    """Refuse DP coordinates that name no shard."""
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"need 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")


def rank_indices(n: int, seed: int, epoch: int, dp_rank: int, dp_size: int, shuffle: bool = True) -> np.ndarray:
    """Record indices rank ``dp_rank`` of ``dp_size`` reads in epoch ``epoch``, in order."""
    check_rank(dp_rank, dp_size)
    return epoch_order(n, seed, epoch, shuffle)[dp_rank::dp_size]
