"""Deal a step's packs over DP ranks by cost, and order each rank's microbatches.

The rule (also in ``docs/packing.md``):

1. **Sort** packs by cost, heaviest first (ties: lower pack index first).
2. **Snake deal**: round ``k`` gives the next ``dp_size`` packs to ranks
   ``0, 1, ..., D-1`` when ``k`` is even and ``D-1, ..., 0`` when ``k`` is odd, so the rank
   that got the heaviest pack of one round gets the lightest of the next.
3. **Swap repair**: while the heaviest rank ``H`` and some rank ``R`` have packs
   ``h`` (in ``H``) and ``r`` (in ``R``) with ``0 < cost(h) - cost(r) < load(H) - load(R)``,
   swap the pair whose difference is closest to half the gap (first such ``R`` in rank
   order on ties).  Each swap keeps counts equal and strictly lowers the sum of squared
   loads, so this ends (differences under 1e-9 of the total cost do not count, and at
   most ``4 * len(costs)`` swaps are made).  It removes the few-percent imbalance that
   snake dealing leaves on heavy-tailed costs.
4. **Microbatch order** within a rank: with ``pp_size == 1`` heaviest first (no stages
   overlap, and the largest activations surface on the first microbatch); with
   ``pp_size > 1`` zig-zag heavy/light: heaviest, lightest, second heaviest, second
   lightest, ..., so consecutive microbatches, which meet in neighbouring pipeline
   stages, pair a heavy one with a light one.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def dispatch(costs: Sequence[float], dp_size: int, pp_size: int = 1) -> list[list[int]]:
    """Return, for each DP rank, the indices of its packs in microbatch order.

    Every rank gets ``len(costs) // dp_size`` packs; a count that does not divide is an
    error.  Deterministic.
    """
    if dp_size < 1 or pp_size < 1:
        raise ValueError(f"dp_size and pp_size must be >= 1, got {dp_size} and {pp_size}")
    cost = np.asarray(costs, dtype=np.float64).reshape(-1)
    n = len(cost)
    if n % dp_size:
        raise ValueError(
            f"{n} packs cannot give {dp_size} DP ranks the same number of microbatches "
            f"({n} % {dp_size} = {n % dp_size}); make the step's pack count a multiple of dp_size"
        )
    per_rank = n // dp_size
    heavy_first = np.lexsort((np.arange(n), -cost))
    # Round k of the snake deal is row k; odd rows are reversed.
    table = heavy_first.reshape(per_rank, dp_size)
    table[1::2] = table[1::2, ::-1]
    ranks = [table[:, d].copy() for d in range(dp_size)]
    _swap_repair(ranks, cost)
    return [_microbatch_order(r, cost, pp_size) for r in ranks]


def _swap_repair(ranks: list[np.ndarray], cost: np.ndarray) -> None:
    # A swap must move more than ``tol`` and leave the pair more than ``tol`` apart, so
    # rounding can never make it cycle; the swap budget is a second guard.
    tol = 1e-9 * float(np.abs(cost).sum())
    for _ in range(4 * len(cost)):
        loads = np.array([cost[r].sum() for r in ranks])
        heavy = int(np.argmax(loads))
        best = None  # (distance to half the gap, rank, i, j)
        for other in range(len(ranks)):
            gap = loads[heavy] - loads[other]
            if gap <= 2 * tol:
                continue
            diff = cost[ranks[heavy]][:, None] - cost[ranks[other]][None, :]
            distance = np.where((diff > tol) & (diff < gap - tol), np.abs(diff - gap / 2), np.inf)
            i, j = np.unravel_index(np.argmin(distance), distance.shape)
            if np.isfinite(distance[i, j]) and (best is None or distance[i, j] < best[0]):
                best = (distance[i, j], other, int(i), int(j))
        if best is None:
            return
        _, other, i, j = best
        ranks[heavy][i], ranks[other][j] = ranks[other][j], ranks[heavy][i]


def _microbatch_order(packs: np.ndarray, cost: np.ndarray, pp_size: int) -> list[int]:
    ordered = packs[np.lexsort((packs, -cost[packs]))]
    if pp_size == 1:
        return ordered.tolist()
    zigzag = np.empty_like(ordered)
    half = (len(ordered) + 1) // 2
    zigzag[0::2] = ordered[:half]
    zigzag[1::2] = ordered[half:][::-1]
    return zigzag.tolist()
