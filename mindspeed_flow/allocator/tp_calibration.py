"""TP calibration: per-TP-size correction factors fitted to a profile's measured points.

The formula model of one layer on a TP group (compute at the tp=1 efficiency curve, the
backward as the module's median backward/forward ratio, plus Megatron's TP all-reduces
over a link) misses what a real TP run adds or saves: launch and synchronisation costs,
GEMM shapes that split badly, the collective library's own overheads.  Against the
measured CPU TP-2 points the formula alone was 0.35x-2.2x off.

So for every point ``p`` the profile measured (any TP size) a factor is fitted::

    measured(p) = factor * (1 + ratio) * compute(p) + 2 * comm(p)

with ``compute`` and ``comm`` evaluated on the profiled device (its peak, and the link TP
ran over while profiling: ``Profile.tp_link_gbps`` / ``tp_link_latency_us``).  The factor
corrects compute only, so it carries over to a device with another peak and link: there
the proxy predicts ``factor * compute + comm`` with the target cluster's numbers.

Between a TP size's measured work sizes the factor is piecewise linear in log FLOPs per
rank and flat outside them.  At a measured TP size the factor is that size's own (so the
proxy reproduces every measured point); between measured TP sizes it is linear in log tp;
beyond the largest measured size it is extrapolated along the least-squares line in log tp
through every measured size's factor (at the same work per rank), anchored at the largest
one, and never below it: a falling trend is held, not followed towards zero.  Below the
smallest measured size, and with one measured size only, that size's curve is held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .errors import AllocatorError
from .profile import Profile

Curve = Sequence[tuple[float, float]]  # (log x, y) sorted by log x


def piecewise_log(curve: Curve, x: float) -> float:
    """``curve`` read at ``x``: linear in ``log x`` between points, flat outside them."""
    lx = math.log(x)
    if lx <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if lx <= x1:
            return y0 + (y1 - y0) * (lx - x0) / (x1 - x0) if x1 > x0 else y1
    return curve[-1][1]


# (module, tp, flops per layer and rank, micro batch, seq, hidden) -> (compute s, comm s) per layer
FormulaTerms = Callable[[str, int, float, int, int, int], tuple[float, float]]


@dataclass(frozen=True)
class TPCalibration:
    """Fitted compute factors of one profile, per module and measured TP size."""

    curves: dict[str, dict[int, tuple[tuple[float, float], ...]]]

    @classmethod
    def fit(cls, profile: Profile, backward_ratio: dict[str, float], terms: FormulaTerms) -> "TPCalibration":
        """Factors for every point of ``profile``; ``terms`` gives the formula's compute and
        communication seconds of one layer on the profiled device."""
        curves: dict[str, dict[int, list[tuple[float, float]]]] = {}
        for index, p in enumerate(profile.points):
            if p.tp > 1 and p.hidden < 1:
                raise AllocatorError(f"profile ({profile.device}): points[{index}] (tp={p.tp}) has no hidden size; "
                                     "TP points need it to separate communication from compute")
            per_layer = p.flops / p.layers
            compute, comm = terms(p.module, p.tp, per_layer, p.micro_batch, p.seq, p.hidden)
            measured = (p.forward_s + p.backward_s) / p.layers
            factor = (measured - 2 * comm) / ((1 + backward_ratio[p.module]) * compute)
            if factor <= 0:
                raise AllocatorError(
                    f"profile ({profile.device}): points[{index}] took {measured:.3g} s per layer, less than the "
                    f"{2 * comm:.3g} s its TP all-reduces take over the profile's tp link; check tp_link_gbps")
            curves.setdefault(p.module, {}).setdefault(p.tp, []).append((math.log(per_layer), factor))
        return cls({m: {tp: tuple(sorted(c)) for tp, c in by_tp.items()} for m, by_tp in curves.items()})

    def factor(self, module: str, tp: int, flops_per_rank: float) -> float:
        """The compute factor of one layer doing ``flops_per_rank`` FLOPs per rank at ``tp``."""
        by_tp = self.curves.get(module)
        if not by_tp:
            return 1.0
        sizes = sorted(by_tp)
        if tp <= sizes[0]:
            return piecewise_log(by_tp[sizes[0]], flops_per_rank)
        if tp >= sizes[-1]:
            return self._extrapolated(by_tp, sizes, tp, flops_per_rank)
        upper = next(s for s in sizes if s >= tp)
        lower = max(s for s in sizes if s <= tp)
        low, high = (piecewise_log(by_tp[s], flops_per_rank) for s in (lower, upper))
        if upper == lower:
            return low
        return low + (high - low) * math.log(tp / lower) / math.log(upper / lower)

    @staticmethod
    def _extrapolated(by_tp: dict[int, tuple[tuple[float, float], ...]], sizes: list[int], tp: int,
                      flops_per_rank: float) -> float:
        """Beyond the largest measured TP size: the largest size's factor plus the
        least-squares slope (in log tp, over every measured size, floored at 0) times how
        far ``tp`` lies beyond it."""
        xs = [math.log(s) for s in sizes]
        ys = [piecewise_log(by_tp[s], flops_per_rank) for s in sizes]
        if len(sizes) < 2:
            return ys[-1]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return ys[-1] + max(slope, 0.0) * (math.log(tp) - xs[-1])
