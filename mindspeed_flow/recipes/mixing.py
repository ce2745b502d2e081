"""Loss-driven mixing of a multimodal and a text-only source, on top of the loaders' public
API (``iter``, ``state_dict``, ``load_state_dict``; :class:`~mindspeed_flow.data.FlowDataLoader`
has them).

Each step draws the source of the next batch: multimodal with probability ``p``, else text.
``p`` follows the sources' training losses (reported with :meth:`LossDrivenMixer.report_loss`):
per source an exponential moving average ``m_s`` (``beta``), and::

    p = clip(base * m_mm^gamma / (base * m_mm^gamma + (1 - base) * m_text^gamma), low, high)

so the source that lags (higher loss) is drawn more often, never outside ``[low, high]``;
before both sources have a loss, ``p = base``.  ``gamma = 0`` keeps ``p = base``.

The draws come from the mixer's own seeded generator.  :meth:`state_dict` holds ``p``'s
inputs, the generator, and each loader's state, so a resumed run makes the same choices and
reads the same batches.  Each batch carries its source under ``"mix_source"``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

SOURCES = ("multimodal", "text")
SOURCE_KEY = "mix_source"


class ResumableLoader(Protocol):
    def __iter__(self) -> Iterator[dict[str, Any]]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


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


class LossDrivenMixer:
    """Iterate batches from ``multimodal`` and ``text`` in a loss-driven ratio."""

    def __init__(self, multimodal: ResumableLoader, text: ResumableLoader, config: MixingConfig = MixingConfig()):
        self.loaders = {"multimodal": multimodal, "text": text}
        self.config = config
        self.averages: dict[str, float] = {}
        self.rng = random.Random(config.seed)
        self._iters: dict[str, Iterator[dict[str, Any]]] = {}

    @property
    def ratio(self) -> float:
        """The current probability of drawing the multimodal source."""
        c = self.config
        if len(self.averages) < 2:
            return c.base
        mm = c.base * self.averages["multimodal"] ** c.gamma
        text = (1 - c.base) * self.averages["text"] ** c.gamma
        return min(c.high, max(c.low, mm / (mm + text))) if mm + text > 0 else c.base

    def report_loss(self, source: str, loss: float) -> None:
        if source not in self.loaders:
            raise ValueError(f"unknown mixing source {source!r}; sources: {', '.join(SOURCES)}")
        old = self.averages.get(source)
        self.averages[source] = float(loss) if old is None else self.config.beta * old + (1 - self.config.beta) * loss

    def _next_from(self, source: str) -> dict[str, Any]:
        """The source's next batch; an exhausted source starts its next epoch."""
        for _ in range(2):
            it = self._iters.get(source) or iter(self.loaders[source])
            self._iters[source] = it
            try:
                return next(it)
            except StopIteration:
                self._iters.pop(source)
        raise RuntimeError(f"mixing source {source!r} yields no batches")

    def __iter__(self) -> Iterator[dict[str, Any]]:
        while True:
            source = "multimodal" if self.rng.random() < self.ratio else "text"
            batch = self._next_from(source)
            yield {**batch, SOURCE_KEY: source}

    def state_dict(self) -> dict[str, Any]:
        return {"averages": dict(self.averages), "rng": self.rng.getstate(), "ratio": self.ratio,
                "loaders": {name: loader.state_dict() for name, loader in self.loaders.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.averages = dict(state["averages"])
        self.rng.setstate(state["rng"])
        for name, loader in self.loaders.items():
            loader.load_state_dict(state["loaders"][name])
        self._iters = {}

    def describe(self) -> str:
        avg = ", ".join(f"{s} {self.averages[s]:.4f}" for s in SOURCES if s in self.averages)
        return f"multimodal ratio {self.ratio:.3f}" + (f" (loss averages {avg})" if avg else "")
