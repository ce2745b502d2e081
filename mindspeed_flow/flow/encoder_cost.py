"""The encoder's cost of a batch of samples, so its batches are cut by its own work.

A ViT attends over the patches of each image separately, so a batch whose images have
``p_1..p_k`` patches costs

    quadratic * sum(p_i ** 2) + linear * sum(p_i) + per_image * k

(attention; per-patch projections and MLP; per-image work such as the merger and the
launches).  The LLM's cost of the same samples is a different function of different lengths
(:class:`~mindspeed_flow.packing.CostModel`), which is why the encoder's batches and the
backbone's microbatches are grouped separately (:mod:`.grouping`).  The coefficients are
fitted to measured ``(batch, seconds)`` pairs by the packer's non-negative least squares
(:func:`mindspeed_flow.packing.cost_model.fit_nonnegative`, which :meth:`CostModel.fit` uses too), so a noisy fit can
never make a large image look cheap.

``scripts/calibrate_cost_model.py`` writes the fitted terms under the ``encoder_cost`` key
of its JSON (:data:`CALIBRATION_KEY`); :meth:`EncoderCost.load` reads them back and
:meth:`EncoderCost.from_terms` checks terms written inline (a layout's
``flow_encoder_cost``, the trainer's ``data.encoder_cost``).  A budget in patches becomes a
budget under any cost by :meth:`EncoderCost.image_cost`: a batch may cost what one image of
that many patches costs (with the default cost, :data:`PATCHES`, exactly that many patches).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..calibration_file import read_calibrated_terms
from ..packing.cost_model import fit_nonnegative
from .errors import EncoderCostError, SampleError
from .meta import SampleMeta

TERMS = ("quadratic", "linear", "per_image")
CALIBRATION_KEY = "encoder_cost"  # where scripts/calibrate_cost_model.py writes the fitted terms


@dataclass(frozen=True)
class EncoderCost:
    """Seconds (or any unit the coefficients carry) of one encoder batch; all >= 0."""

    quadratic: float = 0.0
    linear: float = 0.0
    per_image: float = 0.0

    def __post_init__(self) -> None:
        for name in TERMS:
            if getattr(self, name) < 0:
                raise SampleError(f"EncoderCost.{name} must be >= 0, got {getattr(self, name)}")

    def cost(self, samples: Iterable[SampleMeta]) -> float:
        """The encoder's cost of one batch of ``samples`` (0 for text-only samples)."""
        return float(np.dot(features(samples), [self.quadratic, self.linear, self.per_image]))

    def image_cost(self, patches: int) -> float:
        """The cost of one batch holding one image of ``patches`` patches: the budget a batch
        gets when the budget is given in patches (with :data:`PATCHES`, ``patches`` itself)."""
        return self.quadratic * patches * patches + self.linear * patches + self.per_image

    @classmethod
    def from_terms(cls, terms: Mapping[str, Any], where: str) -> "EncoderCost":
        """The cost of ``terms`` (``quadratic``, ``linear``, ``per_image``; an unset one is 0),
        refused with an :class:`EncoderCostError` prefixed by ``where`` when a term is unknown,
        not a number or negative, or when all are 0 (no cost to cut batches by)."""
        if not isinstance(terms, Mapping):
            raise EncoderCostError(f"{where}: expected a mapping of {', '.join(TERMS)}, got "
                                   f"{type(terms).__name__} {terms!r}")
        unknown = sorted(set(terms) - set(TERMS))
        if unknown:
            raise EncoderCostError(f"{where}: unknown term {unknown[0]} (known: {', '.join(TERMS)})")
        for name, value in terms.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise EncoderCostError(f"{where}: {name}: expected a number, got {type(value).__name__} {value!r}")
            if value < 0:
                raise EncoderCostError(f"{where}: {name} must be >= 0, got {value}")
        cost = cls(**{name: float(value) for name, value in terms.items()})
        if cost == cls():
            raise EncoderCostError(f"{where}: the terms ({', '.join(TERMS)}) are all 0: no cost to cut batches by")
        return cost

    @classmethod
    def load(cls, path: str | Path) -> "EncoderCost":
        """The cost fitted by ``scripts/calibrate_cost_model.py``: the ``encoder_cost`` mapping
        of its JSON at ``path``; errors name the file and the key."""
        where = f"{path}: {CALIBRATION_KEY}"
        terms = read_calibrated_terms(path, CALIBRATION_KEY, TERMS, where=str(path), error=EncoderCostError)
        return cls.from_terms(terms, where)

    @classmethod
    def fit(cls, observations: Iterable[tuple[Sequence[SampleMeta], float]]) -> "EncoderCost":
        """Fit the coefficients to measured ``(batch, seconds)`` pairs (at least 3)."""
        return cls(*fit_nonnegative(
            observations, features, len(TERMS),
            too_few=lambda got: SampleError(f"EncoderCost.fit: need at least {len(TERMS)} observations, got {got}")))


def features(samples: Iterable[SampleMeta]) -> list[float]:
    """``[sum p^2, sum p, images]`` over every image of ``samples``: the terms the cost weighs."""
    patches = np.array([p for s in samples for p in s.patches], dtype=np.float64)
    return [float((patches * patches).sum()), float(patches.sum()), float(len(patches))]


PATCHES = EncoderCost(linear=1.0)  # the default cost: a batch's ViT patches
