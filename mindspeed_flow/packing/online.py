"""``BestFitPacker``: online best fit with a bounded window of open packs."""

from __future__ import annotations

from collections import deque
from typing import Hashable

from .lengths import as_length
from .overlong import Overlong, admit, check_policy
from .segment_tree import CapacityTree
from .stats import PackStats


class BestFitPacker:
    """Online best-fit packing for a stream of items.

    Each item goes into the open pack with the smallest remaining space that fits it
    (O(log C): a :class:`CapacityTree` over the remaining-space values of open packs, a
    FIFO of packs per value).  Ties between packs with the same remaining space go to the
    one that has had that remaining space longest (FIFO order), which is not always the
    pack opened first.

    A pack closes, and is returned by the :meth:`add` call that closed it, when

    - it is **full** (remaining space 0): nothing can join it any more; or
    - the **window is exceeded**: an item fits no open pack, ``window`` packs are already
      open, so one must close before a new pack opens.  The pack that closes is the
      *fullest* open pack (smallest remaining space; among equals the first in FIFO
      order, as above): it is the one least likely to take another item, and closing it
      wastes the least space.

    ``window`` is thus the look-ahead: a pack can collect items for as long as it stays
    among the ``window`` open packs.  :meth:`flush` closes the rest in the order they were opened.
    Deterministic: the same stream gives the same packs in the same order.
    """

    def __init__(self, capacity: int, window: int = 1024, overlong: Overlong = "error") -> None:
        capacity, window = as_length(capacity, "capacity"), as_length(window, "window")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        check_policy(overlong)
        self.capacity = capacity
        self.window = window
        self.overlong = overlong
        self.stats = PackStats(capacity=capacity)
        self._tree = CapacityTree(capacity)
        self._by_room: dict[int, deque[int]] = {}  # remaining space -> open pack ids, FIFO
        self._items: dict[int, list[Hashable]] = {}  # open pack id -> its items (dicts keep age order)
        self._next_id = 0

    def add(self, item_id: Hashable, length: int) -> list[list[Hashable]]:
        """Place one item; return the packs this placement closed (often none).

        ``length`` is an int, a numpy integer or a 0-d integer tensor (anything else is a
        ``TypeError`` naming the item).  An item refused with an error leaves the packer
        (and its stats) as it was."""
        if type(length) is not int:  # the common case skips the call
            length = as_length(length, f"length of item {item_id!r}")
        chunks = admit(item_id, length, self.capacity, self.overlong, self.stats)
        self.stats.items += 1
        closed: list[list[Hashable]] = []
        for chunk in chunks:
            room = self._tree.successor(chunk)
            if room >= 0:
                pack_id = self._take(room)
            else:
                # A chunk of exactly ``capacity`` closes at once: it needs no window slot.
                if len(self._items) >= self.window and chunk < self.capacity:
                    closed.append(self._close(self._take(self._tree.successor(1))))
                    self.stats.closed_window += 1
                pack_id = self._next_id
                self._next_id += 1
                self._items[pack_id] = []
                room = self.capacity
            self._items[pack_id].append(item_id)
            self.stats.tokens += chunk
            room -= chunk
            if room:
                self._put(pack_id, room)
            else:
                closed.append(self._close(pack_id))
                self.stats.closed_full += 1
        return closed

    def flush(self) -> list[list[Hashable]]:
        """Close every open pack and return them, in the order they were opened."""
        rest = [self._close(pack_id) for pack_id in list(self._items)]
        self.stats.closed_flush += len(rest)
        self._tree = CapacityTree(self.capacity)
        self._by_room.clear()
        return rest

    def __len__(self) -> int:
        """Number of open packs."""
        return len(self._items)

    def _put(self, pack_id: int, room: int) -> None:
        queue = self._by_room.get(room)
        if queue is None:
            self._by_room[room] = deque((pack_id,))
            self._tree.add(room)
        else:
            queue.append(pack_id)

    def _take(self, room: int) -> int:
        queue = self._by_room[room]
        pack_id = queue.popleft()
        if not queue:
            del self._by_room[room]
            self._tree.remove(room)
        return pack_id

    def _close(self, pack_id: int) -> list[Hashable]:
        self.stats.packs += 1
        return self._items.pop(pack_id)
