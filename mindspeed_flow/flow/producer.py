"""The flow's producer: an encoder replica that puts one pool entry per sample.

For each step's :class:`~.grouping.FlowGrouping`, the producer encodes its own share of the
encoder's batches (:meth:`~.grouping.FlowGrouping.replica_batches`, cut by the encoder's cost
in the order the backbone needs the samples) and puts each sample's embedding rows under
:class:`~.meta.SampleKey` ``flow/step<n>/act/<id>`` with its :class:`~.meta.SampleMeta` as the
entry's metadata.  What a batch's input is belongs to the model: ``encode(metas)`` returns
the batch's embedding rows, its samples' image tokens end to end in the batch's order.

- **Trainable encoder**: the producer keeps each batch's output with its graph and, as the
  backbone puts the samples' embedding gradients back (``flow/step<n>/grad/<id>``), collects
  them whichever comes first; a batch's backward runs as soon as all its samples' gradients
  are in.  It stays within the step: its weights change at the step boundary
  (:meth:`EmbeddingProducer.run` calls ``after_step`` between steps).
- **Frozen encoder**: no graph, no gradients; :meth:`EmbeddingProducer.run` goes on into
  the next steps' samples without waiting for the backbone, bounded by the pool's capacity
  (a put that does not fit waits: back-pressure, never eviction) and by ``max_in_flight``
  entries put and not yet taken.  A caller whose step must end (a trainer joining the
  step's collectives) calls :meth:`EmbeddingProducer.run_ahead` instead: it encodes the next
  step's batches only while their entries fit and never waits; :meth:`EmbeddingProducer.forward`
  of that step then puts what did not fit and encodes only the rest.

A put that waits lets a trainable producer collect gradients meanwhile, so a pool smaller
than a step's embeddings cannot stall the flow.  :class:`ProducerStats` records what was
done, for tests and the job's report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ..pool import Pool, PoolFull
from ..schedule.keys import BoundaryKind
from .errors import StreamError
from .grouping import FlowGrouping
from .meta import SampleKey, SampleMeta
from .transfers import Waiting, put_waiting, take_ready

ACT, GRAD = BoundaryKind.ACT, BoundaryKind.GRAD
Encode = Callable[[Sequence[SampleMeta]], torch.Tensor]
# ``record(kind, step, batch, start, end)``: one producer action (``"F"``, ``"PUT"``, ``"B"``)
# in ``time.monotonic()`` seconds, for a caller's timeline (the job's Gantt chart).
Record = Callable[[str, int, int, float, float], None]


@dataclass
class ProducerStats:
    """What a producer did, in order: ``forwards`` and ``backwards`` as ``(step, batch)``
    (batch: the index into the step's ``grouping.batches``), bytes put, and how many slices
    its puts waited for space (back-pressure)."""

    forwards: list[tuple[int, int]] = field(default_factory=list)
    backwards: list[tuple[int, int]] = field(default_factory=list)
    bytes_put: int = 0
    full_waits: int = 0

    def step_counts(self, step: int) -> tuple[int, int]:
        """Forwards and backwards of ``step`` (those run ahead during an earlier step too)."""
        return (sum(1 for s, _ in self.forwards if s == step), sum(1 for s, _ in self.backwards if s == step))

    def forget_through(self, step: int) -> None:
        """Drop the records of steps up to ``step``: a producer kept for a whole job keeps
        only what a later step may still count."""
        self.forwards = [f for f in self.forwards if f[0] > step]
        self.backwards = [b for b in self.backwards if b[0] > step]


@dataclass
class _Pending:
    """A trainable batch between its forward and its backward."""

    output: torch.Tensor
    metas: list[SampleMeta]
    grads: dict[int, torch.Tensor] = field(default_factory=dict)


class EmbeddingProducer:
    """Encoder replica ``replica`` of a flow job (see the module).

    Args:
        pool: this rank's view of the job's pool.
        encode: the batch's embedding rows from its samples' metadata (the caller looks up
            their pixels); ``[sum of image_tokens, hidden]`` in the batch's sample order.
        replica: which encoder replica this is (its batches in each grouping).
        trainable: whether the encoder trains (keep graphs, run backwards).
        max_in_flight: at most this many of this producer's entries put and not yet taken
            (``None``: the pool's capacity alone bounds it).
        timeout_s: how long one put, or one wait for gradients, may wait.
        record: called with each forward, batch of puts and backward as it ends (see
            :data:`Record`).
    """

    def __init__(self, pool: Pool, encode: Encode, *, replica: int, trainable: bool,
                 max_in_flight: int | None = None, timeout_s: float = 60.0, record: Record | None = None) -> None:
        if max_in_flight is not None and max_in_flight < 1:
            raise StreamError(f"flow producer {replica}: max_in_flight must be >= 1 or None, got {max_in_flight}")
        self.pool = pool
        self.encode = encode
        self.replica = replica
        self.trainable = trainable
        self.max_in_flight = max_in_flight
        self.timeout_s = timeout_s
        self.stats = ProducerStats()
        self._pending: dict[tuple[int, int], _Pending] = {}
        self._in_flight: list[str] = []  # keys put and maybe not taken yet
        self._record = record
        self._encoded: set[tuple[int, int]] = set()  # (step, batch) already encoded (ahead, frozen)
        self._held: list[SampleMeta] = []  # encoded ahead, not put yet: the pool had no room
        self._held_rows: list[torch.Tensor] = []

    # ------------------------------------------------------------------ the steps

    def run(self, groupings: Iterable[FlowGrouping],
            after_step: Callable[[FlowGrouping], None] | None = None) -> ProducerStats:
        """Every step of ``groupings`` in order: a frozen encoder encodes step after step
        without waiting for the backbone; a trainable one finishes each step's backwards,
        then calls ``after_step(grouping)`` (its optimizer step) before the next step.  Ends
        when the backbone has taken everything put."""
        for grouping in groupings:
            self.forward(grouping)
            if self.trainable:
                self.backward(grouping)
            if after_step is not None:
                after_step(grouping)
        self.wait_taken()
        return self.stats

    def forward(self, grouping: FlowGrouping) -> None:
        """Encode this replica's batches of ``grouping`` and put every sample's rows (the
        batches :meth:`run_ahead` encoded already are put, not encoded again)."""
        self._still_in_flight()  # keys taken since: a producer kept across steps forgets them
        self._put_held()
        batches = [b for b in grouping.replica_batches(self.replica) if (grouping.step, b) not in self._encoded]
        self.pool.announce(str(m.key(ACT)) for b in batches for m in grouping.metas(grouping.batches[b]))
        for b in batches:
            metas, rows = self._encode(grouping, b)
            started = time.monotonic()
            for meta, part in zip(metas, rows):
                self._put(meta, part)
            self._note("PUT", grouping.step, b, started)
        self._encoded = {(step, b) for step, b in self._encoded if step > grouping.step}

    def run_ahead(self, grouping: FlowGrouping) -> int:
        """Frozen encoder: encode this replica's batches of a later step's ``grouping`` now,
        while their entries fit: it stops before a batch when ``max_in_flight`` entries are
        in flight, and keeps what the pool has no room for until :meth:`forward` of that step
        puts it (never waits, so the caller can end its step).  Returns the batches encoded."""
        if self.trainable:
            raise StreamError(f"flow producer {self.replica}: a trainable encoder cannot run ahead into step "
                              f"{grouping.step} (its weights change at the step boundary)")
        done = 0
        for b in grouping.replica_batches(self.replica):
            if (grouping.step, b) in self._encoded:
                continue
            if self._held or (self.max_in_flight is not None and self._still_in_flight() >= self.max_in_flight):
                break
            metas = grouping.metas(grouping.batches[b])
            self.pool.announce(str(m.key(ACT)) for m in metas)
            metas, rows = self._encode(grouping, b)
            self._encoded.add((grouping.step, b))
            done += 1
            started = time.monotonic()
            for meta, part in zip(metas, rows):
                if self._held or not self._try_put(meta, part):
                    self._held.append(meta)
                    self._held_rows.append(part)
            self._note("PUT", grouping.step, b, started)
        return done

    def discard(self, step: int) -> int:
        """Frozen encoder: give up what :meth:`run_ahead` encoded for ``step`` (the caller's
        next step turned out not to be that one: a job's last validation after a budget
        ended its training early).  Its entries still in the pool are released, the ones
        held for lack of room dropped, and a later :meth:`forward` of a step numbered
        ``step`` encodes all its batches.  Returns the entries dropped."""
        put = [k for k in self._in_flight if SampleKey.parse(k).step == step and self.pool.ready(k)]
        for key in put:
            self.pool.release(key)
        self._in_flight = [k for k in self._in_flight if SampleKey.parse(k).step != step]
        kept = [(m, r) for m, r in zip(self._held, self._held_rows) if m.step != step]
        dropped = len(put) + len(self._held) - len(kept)
        self._held, self._held_rows = [m for m, _ in kept], [r for _, r in kept]
        self._encoded = {(s, b) for s, b in self._encoded if s != step}
        return dropped

    @property
    def ahead(self) -> list[str]:
        """Keys of later steps' entries this producer encoded ahead and the backbone has not
        taken yet (put or held): a checkpoint taken now does not hold them, a resumed run
        encodes them again."""
        return [k for k in self._in_flight if self.pool.ready(k)] + [str(m.key(ACT)) for m in self._held]

    def _encode(self, grouping: FlowGrouping, b: int) -> tuple[list[SampleMeta], list[torch.Tensor]]:
        """Batch ``b`` of ``grouping`` encoded: its samples and each one's rows."""
        metas = grouping.metas(grouping.batches[b])
        started = time.monotonic()
        if self.trainable:
            output = self.encode(metas)
        else:
            with torch.no_grad():
                output = self.encode(metas)
        self.stats.forwards.append((grouping.step, b))
        self._note("F", grouping.step, b, started)
        rows = _split_rows(output, metas, f"flow producer {self.replica}: step {grouping.step} batch {b}")
        if self.trainable:
            self._pending[(grouping.step, b)] = _Pending(output, list(metas))
        return metas, rows

    def _note(self, kind: str, step: int, batch: int, started: float) -> None:
        if self._record is not None:
            self._record(kind, step, batch, started, time.monotonic())

    def backward(self, grouping: FlowGrouping) -> None:
        """Run the backward of each of this replica's batches of ``grouping`` as soon as its
        samples' gradients are all in the pool (in whatever order they complete)."""
        if not self.trainable:
            raise StreamError(f"flow producer {self.replica}: a frozen encoder runs no backward")
        waiting = Waiting(self.pool, self.timeout_s,
                          f"flow producer {self.replica}: embedding gradients of step {grouping.step}")
        while any(step == grouping.step for step, _ in self._pending):
            if self.collect_gradients():
                waiting.progressed()
            else:
                waiting.idle(self._missing_gradient(grouping.step))

    def wait_taken(self) -> None:
        """Block until the backbone took every entry this producer put (a producer's segment
        holds its entries' bytes: it may close its pool only then)."""
        waiting = Waiting(self.pool, self.timeout_s, f"flow producer {self.replica}: entries not taken")
        while self._still_in_flight():
            if waiting.expired():
                raise StreamError(f"flow producer {self.replica}: the backbone did not take "
                                  f"{', '.join(self._in_flight[:8])} within {self.timeout_s:.3g} s")
            waiting.pause()

    # ------------------------------------------------------------------ gradients

    def collect_gradients(self) -> bool:
        """Take every embedding gradient of a pending batch that is in the pool now, and run
        the backward of each batch that has all of them; whether anything was taken."""
        wanted = {str(m.key(GRAD)): (batch, m) for batch, pending in self._pending.items()
                  for m in pending.metas if m.sample_id not in pending.grads}
        taken = take_ready(self.pool, wanted)
        for key, (_, tensor) in taken.items():
            batch, meta = wanted[key]
            pending = self._pending[batch]
            if tensor.shape != (meta.image_tokens, pending.output.shape[-1]):
                raise StreamError(f"flow producer {self.replica}: the gradient of sample {meta.sample_id} (step "
                                  f"{meta.step}) has shape {tuple(tensor.shape)}, its embeddings "
                                  f"({meta.image_tokens}, {pending.output.shape[-1]})")
            pending.grads[meta.sample_id] = tensor
        for batch in [b for b, p in self._pending.items() if len(p.grads) == len(p.metas)]:
            pending = self._pending.pop(batch)
            grad = torch.cat([pending.grads[m.sample_id] for m in pending.metas]).to(pending.output)
            started = time.monotonic()
            torch.autograd.backward(pending.output, grad_tensors=grad)
            self.stats.backwards.append(batch)
            self._note("B", batch[0], batch[1], started)
        return bool(taken)

    def _missing_gradient(self, step: int) -> str:
        for (s, _), pending in self._pending.items():
            if s == step:
                for m in pending.metas:
                    if m.sample_id not in pending.grads:
                        return str(m.key(GRAD))
        raise AssertionError("no gradient is missing")  # pragma: no cover - the caller checked

    # ------------------------------------------------------------------ puts

    def _put(self, meta: SampleMeta, rows: torch.Tensor) -> None:
        """One sample's entry; waits (collecting gradients meanwhile) for the in-flight
        limit and for space."""
        key = str(meta.key(ACT))
        waiting = Waiting(self.pool, self.timeout_s, f"flow producer {self.replica}: in-flight limit before {key}")
        while self.max_in_flight is not None and self._still_in_flight() >= self.max_in_flight:
            if waiting.expired():
                raise StreamError(f"flow producer {self.replica}: {self.max_in_flight} entries still not taken after "
                                  f"{self.timeout_s:.3g} s, cannot put {key}")
            self.stats.full_waits += 1
            if self._while_full():
                waiting.progressed()
            else:
                waiting.pause()
        self.stats.full_waits += put_waiting(self.pool, key, rows, meta.to_pool_meta(), timeout_s=self.timeout_s,
                                             while_full=self._while_full)
        self.stats.bytes_put += rows.numel() * rows.element_size()
        self._in_flight.append(key)

    def _try_put(self, meta: SampleMeta, rows: torch.Tensor) -> bool:
        """Put one sample's entry if it fits now; whether it did."""
        key = str(meta.key(ACT))
        try:
            self.pool.put(key, rows.contiguous(), meta.to_pool_meta(), timeout=0)
        except PoolFull:
            return False
        self.stats.bytes_put += rows.numel() * rows.element_size()
        self._in_flight.append(key)
        return True

    def _put_held(self) -> None:
        """Put what :meth:`run_ahead` encoded and had no room for (waiting for room now)."""
        held, rows = self._held, self._held_rows
        self._held, self._held_rows = [], []
        for meta, part in zip(held, rows):
            self._put(meta, part)

    def _while_full(self) -> bool:
        return self.trainable and self.collect_gradients()

    def _still_in_flight(self) -> int:
        self._in_flight = [k for k in self._in_flight if self.pool.ready(k)]
        return len(self._in_flight)


def _split_rows(output: torch.Tensor, metas: Sequence[SampleMeta], where: str) -> list[torch.Tensor]:
    """The batch's output cut into its samples' rows (``image_tokens`` each, in order)."""
    counts = [m.image_tokens for m in metas]
    if output.dim() != 2 or output.shape[0] != sum(counts):
        raise StreamError(f"{where}: the encoder returned shape {tuple(output.shape)}, expected "
                          f"({sum(counts)}, hidden): image tokens {counts} of samples {[m.sample_id for m in metas]}")
    return list(torch.split(output.detach(), counts))
