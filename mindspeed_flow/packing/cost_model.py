"""Compute cost of a pack, for balancing by real work instead of by token count.

Under varlen attention a pack of segments ``l_1..l_k`` costs

    constant + linear * sum(l_i) + quadratic * sum(l_i ** 2)

The linear term is everything per token (projections, MLP, norms, embedding, loss);
the quadratic term is attention, which runs inside each segment only, so it grows with
``sum(l_i^2)`` and not with ``(sum l_i)^2``: a pack of one 8k sample costs far more than a
pack of thirty-two 256-token samples with the same token count.  Vision encoder work is
per image and has the same shape in the image's patch count ``p`` (full attention over
the patches of one image): ``encoder_linear * p + encoder_quadratic * p^2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol, Sequence, TypeVar

import numpy as np

from .nnls import nnls

Observation = tuple[Sequence[int], float]  # (segment lengths of one pack, seconds)
Measured = TypeVar("Measured")  # what one observation measured: a pack's lengths, an encoder batch


@dataclass(frozen=True)
class CostModel:
    """Seconds (or any unit the coefficients carry) per pack; all coefficients >= 0."""

    linear: float = 0.0
    quadratic: float = 0.0
    constant: float = 0.0
    encoder_linear: float = 0.0
    encoder_quadratic: float = 0.0

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic", "constant", "encoder_linear", "encoder_quadratic"):
            if getattr(self, name) < 0:
                raise ValueError(f"CostModel.{name} must be >= 0, got {getattr(self, name)}")

    def cost(self, segment_lengths: Sequence[int], image_patches: Sequence[int] = ()) -> float:
        """Cost of one pack: LLM side from its segment lengths, plus the encoder cost of
        its images from their patch counts (none by default)."""
        seg = np.asarray(segment_lengths, dtype=np.float64)
        total = self.constant + self.linear * seg.sum() + self.quadratic * (seg * seg).sum()
        if len(image_patches):
            p = np.asarray(image_patches, dtype=np.float64)
            total += self.encoder_linear * p.sum() + self.encoder_quadratic * (p * p).sum()
        return float(total)

    @classmethod
    def fit(
        cls,
        observations: Iterable[Observation],
        images: Iterable[tuple[Sequence[int], float]] | None = None,
    ) -> "CostModel":
        """Fit coefficients to measured timings by non-negative least squares.

        ``observations``: ``(segment_lengths, seconds)`` per measured pack, for the LLM
        terms.  ``images``: optional ``(patch_counts, seconds)`` per measured encoder call,
        for the encoder terms (left at 0 without them).  Non-negativity keeps a noisy fit
        from producing a negative attention cost that would reward long segments.
        """
        linear, quadratic, constant = _fit_terms(observations, with_constant=True)
        encoder = (0.0, 0.0) if images is None else _fit_terms(images, with_constant=False)
        return cls(linear, quadratic, constant, *encoder)


def _features(lengths: Sequence[int], with_constant: bool) -> list[float]:
    seg = np.asarray(lengths, dtype=np.float64)
    row = [float(seg.sum()), float((seg * seg).sum())]
    return row + [1.0] if with_constant else row


def _fit_terms(observations: Iterable[tuple[Sequence[int], float]], with_constant: bool) -> tuple[float, ...]:
    needed = 3 if with_constant else 2
    return fit_nonnegative(
        observations, lambda lengths: _features(lengths, with_constant), needed,
        too_few=lambda got: ValueError(f"need at least {needed} observations to fit, got {got}"))


def fit_nonnegative(
    observations: Iterable[tuple[Measured, float]],
    features: Callable[[Measured], Sequence[float]],
    needed: int,
    too_few: Callable[[int], Exception],
) -> tuple[float, ...]:
    """Non-negative least-squares coefficients of a cost linear in ``features``.

    ``observations``: ``(what was measured, seconds)`` pairs; ``features(what)`` is its row
    of terms.  Fewer than ``needed`` observations raise ``too_few(count)``, so each cost
    model keeps its own error class and message.  Shared by :meth:`CostModel.fit` and the
    flow's encoder cost (:meth:`mindspeed_flow.flow.EncoderCost.fit`).
    """
    rows, seconds = [], []
    for measured, t in observations:
        rows.append(list(features(measured)))
        seconds.append(float(t))
    if len(rows) < needed:
        raise too_few(len(rows))
    return tuple(float(c) for c in nnls(np.array(rows), np.array(seconds)))


class Priced(Protocol):
    """A fitted cost: :class:`CostModel` (of a pack's segment lengths) or the flow's
    ``EncoderCost`` (of an encoder batch's samples)."""

    def cost(self, measured: Any) -> float: ...


def r_squared(model: Priced, observations: Iterable[tuple[Any, float]]) -> float:
    """Coefficient of determination of ``model.cost`` on ``(what was measured, seconds)``
    pairs (a pack's segment lengths for a :class:`CostModel`)."""
    pairs = [(model.cost(lengths), float(t)) for lengths, t in observations]
    predicted, measured = np.array(pairs).T
    residual = float(((measured - predicted) ** 2).sum())
    spread = float(((measured - measured.mean()) ** 2).sum())
    return 1.0 - residual / spread if spread else float(residual == 0)
