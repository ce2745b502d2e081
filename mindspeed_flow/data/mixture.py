"""``MixtureLoader``: a multimodal and a text-only :class:`~.loader.FlowDataLoader` mixed in
a ratio that follows each source's training loss (the rule:
:mod:`mindspeed_flow.recipes.mixing`).

Each ``next()`` draws the source of the next batch from the mixture's own seeded generator
(multimodal with the current ratio ``p``) and returns that source's next packed batch, with
the source under ``"mix_source"``.  The training loop reports each batch's loss back with
:meth:`MixtureLoader.report_loss` (pass the loss averaged over the data-parallel group, so
every rank's ratio, and the TP/PP peers' choices, stay the same).  A source whose epoch ends
starts its next one; a batch is never taken twice within a source's epoch.

Resume: :meth:`state_dict` holds the ratio's state (the loss averages and the ratio), the
generator, and each source's ``FlowDataLoader.state_dict`` (the exact position of its packer
and decoding workers); a mixture resumed from it draws the same sources and yields the same
batches as the uninterrupted one.
"""

from __future__ import annotations

import random
from typing import Any, Iterator, Mapping, Optional

from mindspeed_flow.recipes.mixing import SOURCES, LossDrivenRatio, MixingConfig

from .errors import ResumeMismatch
from .loader import FlowDataLoader

SOURCE_KEY = "mix_source"
STATE_FORMAT = 1


class MixtureLoader:
    """Iterate batches from ``multimodal`` and ``text`` in a loss-driven ratio (endless: the
    training loop decides when to stop)."""

    def __init__(self, multimodal: FlowDataLoader, text: FlowDataLoader, config: MixingConfig = MixingConfig()):
        self.sources = {"multimodal": multimodal, "text": text}
        self.mixing = LossDrivenRatio(config)
        self.rng = random.Random(config.seed)
        self.draws = 0
        self._epochs: dict[str, Optional[Iterator[dict[str, Any]]]] = dict.fromkeys(SOURCES)

    @property
    def ratio(self) -> float:
        return self.mixing.ratio

    def report_loss(self, source: str, loss: float) -> None:
        """The training loss of a batch from ``source`` (its ``"mix_source"``)."""
        self.mixing.report(source, loss)

    def __iter__(self) -> "MixtureLoader":
        return self

    def __next__(self) -> dict[str, Any]:
        source = "multimodal" if self.rng.random() < self.mixing.ratio else "text"
        self.draws += 1
        return {**self._next_from(source), SOURCE_KEY: source}

    def _next_from(self, source: str) -> dict[str, Any]:
        for _ in range(2):  # the epoch in progress, else the next one
            epoch = self._epochs[source]
            if epoch is None:
                epoch = self._epochs[source] = iter(self.sources[source])
            try:
                return next(epoch)
            except StopIteration:
                self._epochs[source] = None
        raise RuntimeError(f"mixture source {source!r} yields no batch in a whole epoch")

    def describe(self) -> str:
        return f"{self.mixing.describe()}; {self.draws} draw(s)"

    def state_dict(self) -> dict[str, Any]:
        return {"format": STATE_FORMAT, "config": vars(self.mixing.config).copy(), "mixing": self.mixing.state_dict(),
                "rng": self.rng.getstate(), "draws": self.draws,
                "sources": {name: loader.state_dict() for name, loader in self.sources.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("format") != STATE_FORMAT:
            raise ResumeMismatch(f"mixture state format {state.get('format')!r} is not {STATE_FORMAT}")
        mine = vars(self.mixing.config)
        differ = [f"{k}: saved {state['config'].get(k)!r}, now {v!r}" for k, v in mine.items()
                  if state["config"].get(k) != v]
        if differ:
            raise ResumeMismatch("cannot resume this mixture state: " + "; ".join(differ))
        self.mixing.load_state_dict(state["mixing"])
        self.rng.setstate(state["rng"])
        self.draws = int(state["draws"])
        for name, loader in self.sources.items():
            loader.load_state_dict(state["sources"][name])
        self._epochs = dict.fromkeys(SOURCES)  # unfinished loops are replaced by the saved positions
