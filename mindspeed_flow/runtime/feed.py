"""Microbatch ``m``'s data for whichever action needs it, in whatever order.

Megatron calls ``forward_step_func(data_iterator, model)`` and the function takes the next
item itself.  A composed program may run a rank's forwards out of microbatch order (a
transposed encoder owns only some microbatches), so the runtime hands the function a
one-item iterator instead: its ``next()`` yields item ``m`` of the real iterator, pulling
(and keeping for the step) the items before it.  Nothing is pulled unless the function
asks, so a stage whose function never reads data (Megatron's middle stages) reads none.
In microbatch order this is exactly Megatron's behaviour.
"""

from __future__ import annotations

from typing import Any, Iterator


class MicrobatchFeed:
    """The items of one data iterator for one step, by microbatch index."""

    def __init__(self, iterator: Iterator) -> None:
        self.iterator = iterator
        self.items: list[Any] = []

    def item(self, microbatch: int) -> Any:
        while len(self.items) <= microbatch:
            try:
                self.items.append(next(self.iterator))
            except StopIteration:
                raise StopIteration(
                    f"the data iterator ended after {len(self.items)} items; microbatch "
                    f"{microbatch} needs {microbatch + 1}"
                ) from None
        return self.items[microbatch]

    def one_shot(self, microbatch: int) -> "OneShot":
        return OneShot(self, microbatch)


class OneShot:
    """An iterator over exactly microbatch ``m``'s item, pulled when asked for."""

    def __init__(self, feed: MicrobatchFeed, microbatch: int) -> None:
        self.feed = feed
        self.microbatch = microbatch
        self.used = False

    def __iter__(self) -> "OneShot":
        return self

    def __next__(self) -> Any:
        if self.used:
            raise StopIteration(f"microbatch {self.microbatch}'s data was already taken")
        self.used = True
        return self.feed.item(self.microbatch)
