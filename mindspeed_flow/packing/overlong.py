"""What happens to an item that does not fit a pack as it is.

One function decides for one item; the offline packer calls it only for the (rare)
items whose length is zero or above capacity, so both packers share the exact rule.
"""

from __future__ import annotations

from typing import Literal, get_args

from .stats import PackStats

Overlong = Literal["error", "truncate", "split", "drop"]
POLICIES: tuple[str, ...] = get_args(Overlong)


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"overlong policy must be one of {POLICIES}, got {policy!r}")


def admit(item_id: object, length: int, capacity: int, policy: Overlong, stats: PackStats) -> list[int]:
    """Return the chunk lengths to place for one item and count what was done to it.

    The caller counts ``stats.items``; this function counts only the exceptions.

    - ``length < 0``: always an error.
    - ``length == 0``: no chunk; counted in ``stats.zero_length``.  An empty segment
      would put a zero-width entry in ``cu_seqlens`` and spend a pack slot on nothing.
    - ``length > capacity``: by ``policy``: ``"error"`` raises, ``"truncate"`` keeps the
      first ``capacity`` tokens, ``"split"`` cuts into full chunks of ``capacity`` plus the
      remainder (in token order), ``"drop"`` places nothing.
    """
    if length < 0:
        raise ValueError(f"item {item_id!r} has negative length {length}")
    if length == 0:
        stats.zero_length += 1
        return []
    if length <= capacity:
        return [length]
    if policy == "error":
        raise ValueError(
            f"item {item_id!r} has length {length} > capacity {capacity} "
            f"(choose overlong='truncate', 'split' or 'drop' to accept such items)"
        )
    if policy == "truncate":
        stats.truncated += 1
        stats.truncated_tokens += length - capacity
        return [capacity]
    if policy == "split":
        full, rest = divmod(length, capacity)
        chunks = [capacity] * full + ([rest] if rest else [])
        stats.split += 1
        stats.split_chunks += len(chunks)
        return chunks
    stats.dropped += 1
    stats.dropped_tokens += length
    return []
