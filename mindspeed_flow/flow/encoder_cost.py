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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from ..packing.cost_model import fit_nonnegative
from .errors import SampleError
from .meta import SampleMeta

TERMS = ("quadratic", "linear", "per_image")


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
