"""The records of one DP rank for one epoch, decoded, as a stateful ``IterableDataset``.

Worker ``w`` of ``W`` decodes positions ``w, w + W, ...`` of the rank's epoch order
(:func:`.sharding.rank_indices`); torchdata's ``StatefulDataLoader`` takes them round
robin, so the loader sees the rank's order exactly.  The state of a worker is the epoch
and how many of its positions it has handed out; ``StatefulDataLoader`` snapshots it with
every item it passes on, which is what makes samples that were decoded ahead (in flight
in the workers) come back after a resume instead of being lost.  With ``records`` (a subset
of the corpus: one side of a validation split) the order and the shards are drawn over the
subset's positions, which then name its records.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import numpy as np

from torch.utils.data import IterableDataset, get_worker_info

from .decode import BadSample, Decoder, Sample
from .sharding import rank_indices


class RankStream(IterableDataset):
    def __init__(self, decoder: Decoder, seed: int, dp_rank: int, dp_size: int, shuffle: bool = True,
                 records: Optional[np.ndarray] = None) -> None:
        self.decoder = decoder
        self.records = records
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.shuffle = shuffle
        self.epoch = 0
        self.handed_out = 0

    def order(self) -> list[int]:
        """This worker's record indices for the current epoch."""
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        size = len(self.decoder.corpus) if self.records is None else len(self.records)
        ranks = rank_indices(size, self.seed, self.epoch, self.dp_rank, self.dp_size, self.shuffle)
        if self.records is not None:
            ranks = self.records[ranks]
        return ranks[worker::workers].tolist()

    def __iter__(self) -> Iterator[Sample | BadSample]:
        order = self.order()
        while self.handed_out < len(order):
            index = order[self.handed_out]
            self.handed_out += 1
            yield self.decoder(index)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "handed_out": self.handed_out}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.handed_out = int(state["handed_out"])
