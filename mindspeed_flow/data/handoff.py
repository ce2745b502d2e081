"""A training loop's view of a :class:`.FlowDataLoader`: epochs one after another, and
with a group of peers, each step's batches handed to them in one collective.

Why not a collective per ``next()``: a pipeline stage after the first asks for its batch
only after it received the previous stage's activation (MindSpeed-MM's ``get_batch`` runs
on every stage, inside ``forward_step``), and the first stage cannot send that activation
before the collective returns, so a blocking broadcast inside ``next(data_iterator)``
deadlocks every pipeline (PP >= 2), whatever the schedule.

The hand-off instead: :meth:`StepBatches.handoff` (``n`` = the step's microbatches) is
called by *every* rank of the group at a point each of them reaches before the step's first
point-to-point transfer - the start of ``forward_backward_func``, train step and evaluation
alike (:mod:`mindspeed_flow.adapters.mindspeed_mm.data` wraps whatever function
``get_forward_backward_func`` returns).  The decoding rank takes ``n`` batches from its
loader and sends them (:func:`.broadcast.send_step`: a header, one tensor per dtype, on
``device`` for nccl/hccl); the peers receive them and keep them; ``next()`` then only pops a
kept batch, never communicates.  So:

- one decoder per DP replica (the group's source rank), nothing decoded twice;
- no collective a stage can reach only after a receive: the schedule's transfers start once
  every peer holds its step's batches;
- exact resume unchanged: the loader's state lives on the decoding rank and is saved at a
  checkpoint, after the step consumed every batch it handed off (a batch still kept then is
  reported by :attr:`StepBatches.kept`);
- without a group (a replica of one rank), ``next()`` reads the loader directly;
- several model chunks on one rank (the interleaved schedule) share one loader: the first
  chunk's iterator hands off, the others are :class:`ChunkView` s of it.

At ``pp_size == 1`` (TP peers, which ask for each batch at the same time) a ``next()`` that
finds no kept batch hands off that one batch (the peers' ``next()`` meet in the collective);
in a pipeline it raises instead of deadlocking, naming the missing hand-off.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Iterator, Optional

from . import broadcast

log = logging.getLogger("mindspeed_flow.data")


class StepBatches:
    """Iterate a :class:`.FlowDataLoader` across epochs; :meth:`handoff` moves a step's
    batches to the loader's group (see the module docstring)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._epoch: Optional[Iterator[dict[str, Any]]] = None
        self._kept: deque[dict[str, Any]] = deque()
        self._step: list[dict[str, Any]] = []  # the latest hand-off's batches (for ChunkView)
        self.handoffs = 0  # collectives run (steps handed off)
        self.dropped = 0  # kept batches a step did not take, dropped at the next hand-off

    @property
    def kept(self) -> int:
        """Batches handed off and not taken yet."""
        return len(self._kept)

    def __iter__(self) -> "StepBatches":
        return self

    def _pull(self) -> dict[str, Any]:
        """The decoding rank's next batch, the next epoch starting when one ends."""
        for _ in range(2):  # one epoch ending, the next starting
            if self._epoch is None:
                self._epoch = self.loader.decoded_epoch()
            try:
                return next(self._epoch)
            except StopIteration:
                self._epoch = None
        raise RuntimeError(f"FlowDataLoader: DP rank {self.loader.dp_rank} has no sample to pack in a whole epoch")

    def handoff(self, n: int) -> None:
        """Collective over the loader's group (every peer calls it with the same ``n``): the
        decoding rank's next ``n`` batches, kept on every rank for the next ``n`` ``next()``.
        Nothing happens without a group."""
        loader = self.loader
        if loader.group is None:
            return
        if self._kept:
            self.dropped += len(self._kept)
            log.warning("FlowDataLoader: the previous step took %d of its batches fewer than were handed off; "
                        "dropped on %s rank", len(self._kept), "the decoding" if loader.decoding else "a receiving")
            self._kept.clear()
        if loader.decoding:
            try:
                batches = [self._pull() for _ in range(n)]
            except Exception as exc:  # the peers wait in receive_step: tell them, then fail here
                broadcast.send_failure(f"{type(exc).__name__}: {exc}", loader.src, loader.group, loader.device)
                raise
            broadcast.send_step(batches, loader.src, loader.group, loader.device)
        else:
            batches = broadcast.receive_step(loader.src, loader.group, loader.device)
        self.handoffs += 1
        self._step = [dict(b) for b in batches]  # as handed: forward_step may change the dicts it gets
        self._kept.extend(batches)

    def __next__(self) -> dict[str, Any]:
        if self._kept:
            return self._kept.popleft()
        loader = self.loader
        if loader.group is None:
            return self._pull()
        if loader.pp_size > 1:
            raise RuntimeError(
                "FlowDataLoader: next() on a pipeline rank found no batch handed off for this step; the step's "
                "batches must be handed off (StepBatches.handoff) before the schedule's first transfer - a "
                "collective here would deadlock the pipeline (is the packing feature's forward_backward_func "
                "hand-off active?)")
        self.handoff(1)  # TP peers only: they all ask for this batch now
        return self._kept.popleft()


class ChunkView:
    """Another model chunk's iterator on the same rank (the interleaved schedule): the
    batches ``primary`` was handed for the current step, in order, read again.

    Megatron builds one data iterator per model chunk; upstream's are copies of the same
    loader and yield the same batches, so chunk ``c`` of microbatch ``m`` reads what chunk 0
    of microbatch ``m`` read.  A view gives exactly that without a second loader: nothing is
    decoded or handed off twice.  Its position restarts at each of the primary's hand-offs."""

    def __init__(self, primary: StepBatches) -> None:
        self.primary = primary
        self._handoff = -1
        self._next = 0

    def __iter__(self) -> "ChunkView":
        return self

    def __next__(self) -> dict[str, Any]:
        primary = self.primary
        if primary.loader.group is None:
            raise RuntimeError("ChunkView: the primary iterator has no group, so no step is handed off to read again")
        if primary.handoffs != self._handoff:
            self._handoff, self._next = primary.handoffs, 0
        if self._next >= len(primary._step):
            raise RuntimeError(f"ChunkView: this chunk asked for batch {self._next + 1} of a step that was handed "
                               f"{len(primary._step)}")
        self._next += 1
        return dict(primary._step[self._next - 1])
