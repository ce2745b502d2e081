"""Non-negative least squares (Lawson & Hanson's active-set method) in numpy.

The cost model has a handful of coefficients, so the textbook algorithm on the small
dense system is exact and fast; it avoids a scipy dependency.
"""

from __future__ import annotations

import numpy as np


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """Solve ``min ||a x - b||_2`` subject to ``x >= 0``.

    Columns are scaled to unit norm first: cost features differ by many orders of
    magnitude (tokens vs tokens squared vs 1), and the active-set tests compare
    gradients across columns.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    m, n = a.shape
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    tol = 10 * np.finfo(np.float64).eps * max(m, n) * max(1.0, float(np.abs(b).max(initial=0.0)))
    max_iter = 3 * n if max_iter is None else max_iter

    x = np.zeros(n)
    active = np.zeros(n, dtype=bool)  # the "passive" set P: coefficients free to move
    gradient = a.T @ (b - a @ x)
    for _ in range(max_iter):
        if active.all() or gradient[~active].max() <= tol:
            break
        active[np.argmax(np.where(active, -np.inf, gradient))] = True
        while True:
            trial = np.zeros(n)
            trial[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
            if trial[active].min() > 0:
                break
            # Step from x toward the trial point until the first coefficient hits zero.
            blocked = active & (trial <= 0)
            step = np.min(x[blocked] / (x[blocked] - trial[blocked]))
            x = x + step * (trial - x)
            active &= x > tol
            x[~active] = 0.0
        x = trial
        gradient = a.T @ (b - a @ x)
    return x / norms
