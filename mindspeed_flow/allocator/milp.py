"""The allocation MILP, solved by HiGHS (highspy).

Variables: a binary ``x_i`` per encoder candidate and ``y_j`` per backbone candidate (a
candidate is a config with its replica count, see :mod:`.candidates`), integer replica
counts ``n_enc = sum dp_i x_i`` and ``n_bb = sum dp_j y_j``, and the global throughput
``T >= 0`` (samples/s).  Constraints::

    sum x_i = 1,  sum y_j = 1                         one config per module
    sum d_i x_i + sum d_j y_j <= D                    device budget
    T <= sum P_i x_i,  T <= sum C_j y_j               T is at most production and consumption

(TP inside a node, divisibility and memory have already removed candidates.)  Three
solves, lexicographic: (1) maximise ``T``; (2) with ``T >= T* (1 - rel_tol)``, minimise the
mismatch ``sum P_i x_i + sum C_j y_j - 2 T`` (which is ``|P - C|`` at the optimum, since
``T`` then equals ``min(P, C)``); (3) with the mismatch at most its optimum (+ tolerance),
minimise the devices used.  Lexicographic rather than one weighted sum because the three
objectives have different units and no weight is right for every scale; each stage is a
small multiple-choice problem that HiGHS solves in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import highspy
import numpy as np

REL_TOL = 1e-7


@dataclass(frozen=True)
class Choice:
    """The chosen encoder and backbone candidate indices and the objectives."""

    encoder: int
    backbone: int
    throughput: float
    mismatch: float
    devices: int


def lexicographic_key(production: float, consumption: float, devices: int) -> tuple[float, float, int]:
    """The objective as a sort key (smaller is better), for brute force and reports."""
    return (-min(production, consumption), abs(production - consumption), devices)


class AllocationMilp:
    """The model over given candidate rates and sizes; ``solve`` runs the three stages.

    ``excluded`` pairs of (encoder, backbone) index sets can be cut off to find runners-up.
    """

    def __init__(self, production: Sequence[float], enc_devices: Sequence[int], enc_replicas: Sequence[int],
                 consumption: Sequence[float], bb_devices: Sequence[int], bb_replicas: Sequence[int],
                 budget: int) -> None:
        self.p = np.asarray(production, dtype=float)
        self.c = np.asarray(consumption, dtype=float)
        self.de = np.asarray(enc_devices, dtype=float)
        self.db = np.asarray(bb_devices, dtype=float)
        ne, nb = len(self.p), len(self.c)
        h = highspy.Highs()
        h.setOptionValue("output_flag", False)
        h.setOptionValue("mip_rel_gap", 0.0)
        h.setOptionValue("mip_abs_gap", 0.0)
        h.setOptionValue("threads", 1)
        inf = highspy.kHighsInf
        self.x = np.arange(ne)
        self.y = ne + np.arange(nb)
        self.n_enc, self.n_bb, self.t = ne + nb, ne + nb + 1, ne + nb + 2
        count = ne + nb + 3
        lower = np.zeros(count)
        upper = np.concatenate([np.ones(ne + nb), [inf, inf, inf]])
        h.addVars(count, lower, upper)
        h.changeColsIntegrality(ne + nb + 2, np.arange(ne + nb + 2, dtype=np.int32),
                                np.full(ne + nb + 2, highspy.HighsVarType.kInteger))
        self._row(h, 1, 1, self.x, np.ones(ne))
        self._row(h, 1, 1, self.y, np.ones(nb))
        self._row(h, 0, 0, np.append(self.x, self.n_enc), np.append(np.asarray(enc_replicas, float), -1))
        self._row(h, 0, 0, np.append(self.y, self.n_bb), np.append(np.asarray(bb_replicas, float), -1))
        self._row(h, -inf, budget, np.concatenate([self.x, self.y]), np.concatenate([self.de, self.db]))
        self._row(h, -inf, 0, np.append(self.x, self.t), np.append(-self.p, 1))
        self._row(h, -inf, 0, np.append(self.y, self.t), np.append(-self.c, 1))
        self.h = h

    @staticmethod
    def _row(h: highspy.Highs, lower: float, upper: float, index: np.ndarray, value: np.ndarray) -> None:
        h.addRow(lower, upper, len(index), np.asarray(index, dtype=np.int32), np.asarray(value, dtype=float))

    def exclude(self, encoder: int, backbone: int) -> None:
        """Cut off one (encoder, backbone) pair: ``x_e + y_b <= 1``."""
        self._row(self.h, -highspy.kHighsInf, 1, np.array([self.x[encoder], self.y[backbone]]), np.ones(2))

    def exclude_backbone(self, backbones: Sequence[int]) -> None:
        """Cut off a set of backbone candidates (all replica counts of one shape, say)."""
        self._row(self.h, -highspy.kHighsInf, 0, self.y[np.asarray(backbones)], np.ones(len(backbones)))

    def _optimise(self, objective: dict[int, float], maximise: bool) -> bool:
        h = self.h
        cost = np.zeros(h.getNumCol())
        for col, value in objective.items():
            cost[col] = value
        h.changeColsCost(len(cost), np.arange(len(cost), dtype=np.int32), cost)
        h.changeObjectiveSense(highspy.ObjSense.kMaximize if maximise else highspy.ObjSense.kMinimize)
        h.run()
        return h.getModelStatus() == highspy.HighsModelStatus.kOptimal

    def solve(self) -> Choice | None:
        """The lexicographic optimum, or None when the model is infeasible."""
        h = self.h
        rows_before = h.getNumRow()
        try:
            if not self._optimise({int(self.t): 1.0}, maximise=True):
                return None
            best = h.getSolution().col_value[self.t]
            self._row(h, best * (1 - REL_TOL), highspy.kHighsInf, np.array([self.t]), np.ones(1))
            mismatch = {**{int(i): self.p[k] for k, i in enumerate(self.x)},
                        **{int(j): self.c[k] for k, j in enumerate(self.y)}, int(self.t): -2.0}
            if not self._optimise(mismatch, maximise=False):
                return None
            least = h.getObjectiveValue()
            cols = np.array(list(mismatch), dtype=np.int32)
            self._row(h, -highspy.kHighsInf, least + REL_TOL * max(best, 1e-12), cols,
                      np.array(list(mismatch.values())))
            devices = {**{int(i): self.de[k] for k, i in enumerate(self.x)},
                       **{int(j): self.db[k] for k, j in enumerate(self.y)}}
            if not self._optimise(devices, maximise=False):
                return None
            values = np.asarray(h.getSolution().col_value)
        finally:  # drop the stage rows so the model can be solved again (runners-up)
            extra = h.getNumRow() - rows_before
            if extra:
                h.deleteRows(extra, np.arange(rows_before, h.getNumRow(), dtype=np.int32))
        enc = int(np.argmax(values[self.x]))
        bb = int(np.argmax(values[self.y]))
        p, c = self.p[enc], self.c[bb]
        return Choice(enc, bb, min(p, c), abs(p - c), int(self.de[enc] + self.db[bb]))
