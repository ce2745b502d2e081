"""The loss-driven mixing rule: how often the multimodal source is drawn, from the training
losses of a multimodal and a text-only source.

Per source an exponential moving average ``m_s`` of its reported losses (``beta``; the first
report sets it), and the probability of drawing the multimodal source::

    p = clip(base * m_mm^gamma / (base * m_mm^gamma + (1 - base) * m_text^gamma), low, high)

so the source that lags (higher loss) is drawn more often, never outside ``[low, high]``;
before both sources have a loss, ``p = base``; ``gamma = 0`` keeps ``p = base``.  The loader
that draws by it is :class:`mindspeed_flow.data.mixture.MixtureLoader`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

SOURCES = ("multimodal", "text")


@dataclass(frozen=True)
class MixingConfig:
    base: float = 0.5
    low: float = 0.1
    high: float = 0.9
    gamma: float = 1.0
    beta: float = 0.9
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.low <= self.base <= self.high <= 1.0:
            raise ValueError(f"mixing bounds need 0 <= low <= base <= high <= 1, got low={self.low} "
                             f"base={self.base} high={self.high}")
        if not 0.0 <= self.beta < 1.0 or self.gamma < 0:
            raise ValueError(f"mixing needs 0 <= beta < 1 and gamma >= 0, got beta={self.beta} gamma={self.gamma}")


@dataclass
class LossDrivenRatio:
    """The sources' loss averages and the ratio they give; ``state_dict`` resumes it."""

    config: MixingConfig = field(default_factory=MixingConfig)
    averages: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """The current probability of drawing the multimodal source."""
        c = self.config
        if len(self.averages) < len(SOURCES):
            return c.base
        mm = c.base * self.averages["multimodal"] ** c.gamma
        text = (1 - c.base) * self.averages["text"] ** c.gamma
        return min(c.high, max(c.low, mm / (mm + text))) if mm + text > 0 else c.base

    def report(self, source: str, loss: float) -> None:
        if source not in SOURCES:
            raise ValueError(f"unknown mixing source {source!r}; sources: {', '.join(SOURCES)}")
        loss = float(loss)
        if not math.isfinite(loss) or loss < 0:
            raise ValueError(f"mixing source {source!r}: reported loss {loss} is not a finite number >= 0")
        old = self.averages.get(source)
        self.averages[source] = loss if old is None else self.config.beta * old + (1 - self.config.beta) * loss

    def describe(self) -> str:
        avg = ", ".join(f"{s} {self.averages[s]:.4f}" for s in SOURCES if s in self.averages)
        return f"multimodal ratio {self.ratio:.3f}" + (f" (loss averages {avg})" if avg else "")

    def state_dict(self) -> dict[str, Any]:
        return {"averages": dict(self.averages), "ratio": self.ratio}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.averages = dict(state["averages"])
