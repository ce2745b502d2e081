"""What the loader did: samples read, bad input per kind, packs and their fill."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mindspeed_flow.packing import PackStats

from .decode import BAD_KINDS


@dataclass
class LoaderStats:
    """Counters of one rank's loader (they survive ``state_dict``/``load_state_dict``).

    Attributes:
        capacity: tokens per pack.
        samples_seen: records read (bad ones included).
        samples_packed: records that reached a pack (whole or in chunks).
        chunks: pieces packed (a split sample counts once per chunk).
        bad: records skipped (or failed on), per kind (see ``docs/data.md``).
        packs, tokens: packs yielded and the real (sample) tokens in them.
        pad_tokens: padding tokens added to the yielded packs (each padded to a multiple of
            TP x CP for sequence parallelism); they count as padding in :attr:`padding`.
        epochs: epochs completed.
    """

    capacity: int
    samples_seen: int = 0
    samples_packed: int = 0
    chunks: int = 0
    bad: dict[str, int] = field(default_factory=lambda: {kind: 0 for kind in BAD_KINDS})
    packs: int = 0
    tokens: int = 0
    pad_tokens: int = 0
    epochs: int = 0

    @property
    def fill(self) -> float:
        """Fraction of the yielded packs' token slots (``packs * capacity``) holding real tokens."""
        return PackStats(self.capacity, packs=self.packs, tokens=self.tokens).fill

    @property
    def padding(self) -> float:
        """The part of the yielded packs' capacity not holding real tokens (unused or padded)."""
        return 1.0 - self.fill

    def to_dict(self) -> dict:
        return {**asdict(self), "bad": dict(self.bad)}

    @classmethod
    def from_dict(cls, state: dict) -> "LoaderStats":
        return cls(**{**state, "bad": dict(state["bad"])})
