"""Counters that make every non-placement outcome visible.

A packer never changes or loses a sample quietly: truncations, splits, drops and
zero-length items are counted here, and the offline :func:`~mindspeed_flow.packing.pack`
also logs a one-line warning when any of them happened.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PackStats:
    """What a packer did with its input.

    Attributes:
        capacity: the pack capacity in tokens.
        items: items offered (zero-length and dropped ones included).
        packs: packs produced (closed, or returned by ``flush``).
        tokens: tokens placed in packs (after truncation).
        truncated / truncated_tokens: overlong items cut to ``capacity`` / tokens cut off.
        split / split_chunks: overlong items split / chunks they became.
        dropped / dropped_tokens: overlong items left out / their tokens.
        zero_length: zero-length items left out (see ``docs/packing.md``).
        closed_full / closed_window / closed_flush: online packs closed because they were
            full, because the window was exceeded, or by ``flush``.
    """

    capacity: int
    items: int = 0
    packs: int = 0
    tokens: int = 0
    truncated: int = 0
    truncated_tokens: int = 0
    split: int = 0
    split_chunks: int = 0
    dropped: int = 0
    dropped_tokens: int = 0
    zero_length: int = 0
    closed_full: int = 0
    closed_window: int = 0
    closed_flush: int = 0

    @property
    def lower_bound(self) -> int:
        """ceil(tokens / capacity): no packing of these tokens can use fewer packs."""
        return -(-self.tokens // self.capacity)

    @property
    def fill(self) -> float:
        """Fraction of the packs' token slots that hold tokens (1.0 for no packs)."""
        return self.tokens / (self.packs * self.capacity) if self.packs else 1.0

    @property
    def padding(self) -> float:
        return 1.0 - self.fill

    @property
    def altered(self) -> int:
        """Items that were not placed as they came."""
        return self.truncated + self.split + self.dropped + self.zero_length

    def summary(self) -> str:
        return (
            f"{self.items} items -> {self.packs} packs (lower bound {self.lower_bound}, "
            f"fill {self.fill:.4%}); truncated {self.truncated} ({self.truncated_tokens} tokens), "
            f"split {self.split} into {self.split_chunks} chunks, dropped {self.dropped} "
            f"({self.dropped_tokens} tokens), zero-length {self.zero_length}"
        )
