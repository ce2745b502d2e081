"""The allocation MILP, solved by HiGHS (highspy).

Variables: a binary ``x_i`` per encoder candidate and ``y_j`` per backbone candidate (a
candidate is a config with its replica count, see :mod:`.candidates`), a binary ``z_k`` per
co-located candidate (encoder inside the backbone's stage 0, rate ``R_k``: one config
for both modules, see :mod:`.colocated`), integer replica counts ``n_enc = sum dp_i x_i +
sum dp_k z_k`` and ``n_bb = sum dp_j y_j + sum dp_k z_k``, and the global throughput
``T >= 0`` (samples/s).  Constraints::

    sum x_i + sum z_k = 1,  sum y_j + sum z_k = 1     one config per module
    sum d_i x_i + sum d_j y_j + sum d_k z_k <= D      device budget (= D with exact_budget)
    T <= sum P_i x_i + sum R_k z_k                    T is at most production ...
    T <= sum C_j y_j + sum R_k z_k                    ... and consumption

(TP inside a node, divisibility and memory have already removed candidates.)  Pairs that
cannot run together (``Workload.megatron_blocks``) are cut off by one row per group of
backbone candidates, ``sum y_j (group) + sum x_i (encoders the group forbids) <= 1``
(:meth:`AllocationMilp.forbid_pairs`): exact, since at most one of each is chosen.  Three
solves, lexicographic: (1) maximise ``T``; (2) with ``T >= T* (1 - rel_tol)``, minimise the
mismatch ``sum P_i x_i + sum C_j y_j + 2 sum R_k z_k - 2 T`` (which is ``|P - C|`` at the
optimum, since ``T`` then equals ``min(P, C)``, and 0 for a co-located choice); (3) with
the mismatch at most its optimum (+ tolerance), minimise the devices used.  Lexicographic rather than one weighted sum because the three
objectives have different units and no weight is right for every scale; each stage is a
small multiple-choice problem that HiGHS solves in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import highspy
import numpy as np

from .quiet_highs import new_highs

REL_TOL = 1e-7


@dataclass(frozen=True)
class Choice:
    """The chosen candidate indices (an encoder and a backbone, or one co-located) and the
    objectives."""

    encoder: int | None
    backbone: int | None
    joint: int | None
    throughput: float
    mismatch: float
    devices: int


class AllocationMilp:
    """The model over given candidate rates and sizes; ``solve`` runs the three stages.
    HiGHS prints nothing (not even its banner, :mod:`.quiet_highs`) unless ``verbose``.

    Candidates can be cut off (:meth:`exclude_backbone`, :meth:`exclude_joint`) to find
    runners-up.
    """

    def __init__(self, production: Sequence[float], enc_devices: Sequence[int], enc_replicas: Sequence[int],
                 consumption: Sequence[float], bb_devices: Sequence[int], bb_replicas: Sequence[int],
                 budget: int, joint_rate: Sequence[float] = (), joint_devices: Sequence[int] = (),
                 joint_replicas: Sequence[int] = (), *, exact_budget: bool = False, verbose: bool = False) -> None:
        self.p = np.asarray(production, dtype=float)
        self.c = np.asarray(consumption, dtype=float)
        self.r = np.asarray(joint_rate, dtype=float)
        self.de = np.asarray(enc_devices, dtype=float)
        self.db = np.asarray(bb_devices, dtype=float)
        self.dj = np.asarray(joint_devices, dtype=float)
        ne, nb, nj = len(self.p), len(self.c), len(self.r)
        h = new_highs(verbose)
        h.setOptionValue("mip_rel_gap", 0.0)
        h.setOptionValue("mip_abs_gap", 0.0)
        h.setOptionValue("threads", 1)
        inf = highspy.kHighsInf
        self.x = np.arange(ne)
        self.y = ne + np.arange(nb)
        self.z = ne + nb + np.arange(nj)
        binaries = ne + nb + nj
        self.n_enc, self.n_bb, self.t = binaries, binaries + 1, binaries + 2
        count = binaries + 3
        lower = np.zeros(count)
        upper = np.concatenate([np.ones(binaries), [inf, inf, inf]])
        h.addVars(count, lower, upper)
        h.changeColsIntegrality(binaries + 2, np.arange(binaries + 2, dtype=np.int32),
                                np.full(binaries + 2, highspy.HighsVarType.kInteger))
        jr = np.asarray(joint_replicas, dtype=float)
        self._row(h, 1, 1, np.concatenate([self.x, self.z]), np.ones(ne + nj))
        self._row(h, 1, 1, np.concatenate([self.y, self.z]), np.ones(nb + nj))
        self._row(h, 0, 0, np.concatenate([self.x, self.z, [self.n_enc]]),
                  np.concatenate([np.asarray(enc_replicas, float), jr, [-1]]))
        self._row(h, 0, 0, np.concatenate([self.y, self.z, [self.n_bb]]),
                  np.concatenate([np.asarray(bb_replicas, float), jr, [-1]]))
        self._row(h, budget if exact_budget else -inf, budget, np.concatenate([self.x, self.y, self.z]),
                  np.concatenate([self.de, self.db, self.dj]))
        self._row(h, -inf, 0, np.concatenate([self.x, self.z, [self.t]]), np.concatenate([-self.p, -self.r, [1]]))
        self._row(h, -inf, 0, np.concatenate([self.y, self.z, [self.t]]), np.concatenate([-self.c, -self.r, [1]]))
        self.h = h

    @staticmethod
    def _row(h: highspy.Highs, lower: float, upper: float, index: np.ndarray, value: np.ndarray) -> None:
        h.addRow(lower, upper, len(index), np.asarray(index, dtype=np.int32), np.asarray(value, dtype=float))

    def exclude_backbone(self, backbones: Sequence[int]) -> None:
        """Cut off a set of backbone candidates (all replica counts of one shape, say)."""
        self._row(self.h, -highspy.kHighsInf, 0, self.y[np.asarray(backbones)], np.ones(len(backbones)))

    def forbid_pairs(self, encoders: Sequence[int], backbones: Sequence[int]) -> None:
        """No plan may pair any of ``backbones`` with any of ``encoders``."""
        index = np.concatenate([self.x[np.asarray(encoders, dtype=int)], self.y[np.asarray(backbones, dtype=int)]])
        self._row(self.h, -highspy.kHighsInf, 1, index, np.ones(len(index)))

    def exclude_joint(self, joints: Sequence[int]) -> None:
        """Cut off a set of co-located candidates."""
        self._row(self.h, -highspy.kHighsInf, 0, self.z[np.asarray(joints)], np.ones(len(joints)))

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
                        **{int(j): self.c[k] for k, j in enumerate(self.y)},
                        **{int(j): 2 * self.r[k] for k, j in enumerate(self.z)}, int(self.t): -2.0}
            if not self._optimise(mismatch, maximise=False):
                return None
            least = h.getObjectiveValue()
            cols = np.array(list(mismatch), dtype=np.int32)
            self._row(h, -highspy.kHighsInf, least + REL_TOL * max(best, 1e-12), cols,
                      np.array(list(mismatch.values())))
            devices = {**{int(i): self.de[k] for k, i in enumerate(self.x)},
                       **{int(j): self.db[k] for k, j in enumerate(self.y)},
                       **{int(j): self.dj[k] for k, j in enumerate(self.z)}}
            if not self._optimise(devices, maximise=False):
                return None
            values = np.asarray(h.getSolution().col_value)
        finally:  # drop the stage rows so the model can be solved again (runners-up)
            extra = h.getNumRow() - rows_before
            if extra:
                h.deleteRows(extra, np.arange(rows_before, h.getNumRow(), dtype=np.int32))
        if len(self.z) and values[self.z].max() > 0.5:
            k = int(np.argmax(values[self.z]))
            return Choice(None, None, k, float(self.r[k]), 0.0, int(self.dj[k]))
        enc = int(np.argmax(values[self.x]))
        bb = int(np.argmax(values[self.y]))
        p, c = self.p[enc], self.c[bb]
        return Choice(enc, bb, None, float(min(p, c)), float(abs(p - c)), int(self.de[enc] + self.db[bb]))
