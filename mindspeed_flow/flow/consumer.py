"""The flow's consumer: the backbone's first stage takes its microbatches' embeddings from
the pool, sample by sample, and puts their gradients back.

For microbatch ``m`` of a step's :class:`~.grouping.FlowGrouping`, :meth:`EmbeddingConsumer.take`
gets the entry ``flow/step<n>/act/<id>`` of every sample of ``m`` that has images (whichever
is ready first; the producers' batches are not the backbone's microbatches), checks that its
metadata is the sample's and its rows its image tokens, and returns the rows end to end in
the order the microbatch packs its samples: the first stage's image input.

For a trainable encoder the returned tensor is a leaf that requires grad, with a hook that,
when the backbone's backward reaches it, splits its gradient by sample and puts each part
under ``flow/step<n>/grad/<id>`` for the producer that encoded the sample.  The consumer
announces those keys when it takes the embeddings, so a producer waiting for a gradient
knows whom to blame.  :meth:`EmbeddingConsumer.finish` refuses a step whose samples were
not all taken, or whose gradients were not all put, naming them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..pool import Pool
from ..schedule.keys import BoundaryKind
from .errors import StreamError
from .grouping import FlowGrouping
from .meta import SampleMeta
from .transfers import put_waiting, take_all

ACT, GRAD = BoundaryKind.ACT, BoundaryKind.GRAD


@dataclass(frozen=True)
class FlowMicrobatch:
    """One backbone microbatch of a flow step, as a stage's data iterator yields it.

    Attributes:
        step: the training step.
        index: the microbatch's index in ``grouping.microbatches``.
        sample_ids: its samples, in the order it packs them (text-only ones included).
        embeddings: on the first stage, the image embeddings of those samples end to end
            (``None`` on later stages, or when none of its samples has an image).
    """

    step: int
    index: int
    sample_ids: tuple[int, ...]
    embeddings: torch.Tensor | None = None


@dataclass
class ConsumerStats:
    """What a consumer did: the samples it took and the gradients it put, as
    ``(step, sample id)`` in order."""

    taken: list[tuple[int, int]] = field(default_factory=list)
    grads_put: list[tuple[int, int]] = field(default_factory=list)
    full_waits: int = 0


class EmbeddingConsumer:
    """The first stage of one backbone replica, on the pool's consumer side (see the module).

    Args:
        pool: this rank's view of the job's pool.
        trainable: whether the encoder trains (gradients go back).
        device: where the embeddings are handed to the model.
        timeout_s: how long one microbatch, or one gradient put, may wait.
    """

    def __init__(self, pool: Pool, *, trainable: bool, device: torch.device | str = "cpu",
                 timeout_s: float = 60.0) -> None:
        self.pool = pool
        self.trainable = trainable
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.stats = ConsumerStats()
        self._grads_due: dict[int, set[int]] = {}  # step -> samples whose gradient is not put yet

    def take(self, grouping: FlowGrouping, microbatch: int) -> torch.Tensor | None:
        """Microbatch ``microbatch``'s image embeddings (see the module); ``None`` when none
        of its samples has an image."""
        pooled = [m for m in grouping.metas(grouping.microbatches[microbatch]) if m.patches]
        if not pooled:
            return None
        keys = {str(m.key(ACT)): m for m in pooled}
        taken = take_all(self.pool, keys, self.timeout_s,
                         f"flow consumer: step {grouping.step} microbatch {microbatch}")
        rows = []
        for key, meta in keys.items():
            handle, tensor = taken[key]
            _check_entry(handle.meta, tensor, meta)
            self.stats.taken.append((meta.step, meta.sample_id))
            rows.append(tensor)
        embeddings = torch.cat(rows).to(self.device)
        if self.trainable:
            self.pool.announce(str(m.key(GRAD)) for m in pooled)
            self._grads_due.setdefault(grouping.step, set()).update(m.sample_id for m in pooled)
            embeddings.requires_grad_()
            embeddings.register_hook(lambda grad: self._put_gradients(grad, pooled))
        return embeddings

    def finish(self, grouping: FlowGrouping, replica: int) -> None:
        """Refuse the end of ``grouping``'s step on backbone replica ``replica`` when one of
        its samples with images was not taken, or (trainable) its gradient not put."""
        expected = [m.sample_id for k in grouping.replica_microbatches(replica)
                    for m in grouping.metas(grouping.microbatches[k]) if m.patches]
        taken = {s for step, s in self.stats.taken if step == grouping.step}
        missing = [s for s in expected if s not in taken]
        if missing:
            raise StreamError(f"flow consumer: step {grouping.step} ended on backbone replica {replica} without "
                              f"taking the embeddings of samples {missing}")
        due = sorted(self._grads_due.pop(grouping.step, set()))
        if due:
            raise StreamError(f"flow consumer: step {grouping.step} ended on backbone replica {replica} without "
                              f"putting the embedding gradients of samples {due} (did the backward reach them?)")

    def _put_gradients(self, grad: torch.Tensor, pooled: list[SampleMeta]) -> None:
        for meta, part in zip(pooled, torch.split(grad.detach(), [m.image_tokens for m in pooled])):
            self.stats.full_waits += put_waiting(self.pool, str(meta.key(GRAD)), part.cpu(), meta.to_pool_meta(),
                                                 timeout_s=self.timeout_s)
            self._grads_due[meta.step].discard(meta.sample_id)
            self.stats.grads_put.append((meta.step, meta.sample_id))


def _check_entry(pool_meta: dict, tensor: torch.Tensor, meta: SampleMeta) -> None:
    """The entry under a sample's key is that sample's: its metadata, and one row per image token."""
    found = SampleMeta.from_pool_meta(pool_meta)
    if found != meta:
        raise StreamError(f"flow consumer: the entry {meta.key(ACT)} carries the metadata of {found}, the step's "
                          f"grouping has {meta}")
    if tensor.dim() != 2 or tensor.shape[0] != meta.image_tokens:
        raise StreamError(f"flow consumer: the entry {meta.key(ACT)} has shape {tuple(tensor.shape)}, sample "
                          f"{meta.sample_id} has {meta.image_tokens} image tokens")
