"""Consumed samples and tokens of packed microbatches, counted for real.

MindSpeed-MM (``mindspeed_mm/training.py``) advances ``args.consumed_train_samples`` and
the learning-rate scheduler by ``dp * micro_batch_size * num_microbatches`` per step: one
sample per microbatch row.  A packed microbatch (``B = 1``) holds several samples, so that
count is wrong, and everything keyed on it (the sample-based LR schedule, the
``--train-samples`` budget, logs, the count saved in checkpoints) drifts.

The contract between the loader and the train loop (feature ``packing``):

- **The loader** calls :func:`record_microbatch` once for every microbatch it hands to
  the train loop (when ``__next__`` returns it), on exactly **one rank per data-parallel
  replica** (the rank that decodes; its TP/PP/CP peers that receive the batch by broadcast
  do not record).  ``samples`` is the number of samples the microbatch completes: usually
  ``len(batch["sample_ids"])``; a sample split over several packs counts once, in the pack
  that holds its last chunk.  ``tokens`` is the number of real (non-padding) tokens.
- **The train step** (the ``packing`` patch on MindSpeed-MM's ``train_step``, every rank)
  calls :meth:`ConsumedAccounting.close_step` once per optimizer step: one all-reduce
  (sum) over the default process group turns the per-rank counts into the step's global
  totals, identical on every rank, and starts the next step from zero.

Only the recording rank of each replica contributes, so summing over *all* ranks counts
every replica exactly once, whatever the TP/PP/CP layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepTotals:
    """What one optimizer step consumed, summed over the data-parallel replicas."""

    samples: int = 0
    tokens: int = 0
    microbatches: int = 0


class ConsumedAccounting:
    """Per-rank counters of the current step, closed by an all-reduce at the step's end."""

    def __init__(self) -> None:
        self._samples = 0
        self._tokens = 0
        self._microbatches = 0

    def record(self, samples: int, tokens: int) -> None:
        """Count one microbatch handed to the train loop (see the module docstring for who calls)."""
        samples, tokens = int(samples), int(tokens)
        if samples < 0 or tokens < 0:
            raise ValueError(f"a microbatch cannot consume {samples} samples / {tokens} tokens")
        self._samples += samples
        self._tokens += tokens
        self._microbatches += 1

    @property
    def pending(self) -> StepTotals:
        """This rank's counts since the last :meth:`close_step` (not reduced)."""
        return StepTotals(self._samples, self._tokens, self._microbatches)

    def close_step(self, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None) -> StepTotals:
        """Global totals of the step that just ran; every rank of ``group`` must call this.

        Without an initialised process group (one process) the local counts are the totals.
        ``device`` is where the all-reduce tensor lives: the CPU for gloo, else the current
        accelerator as Megatron names it, ``torch.cuda.current_device()`` (which MindSpeed's
        ``transfer_to_npu`` maps to the NPU).
        """
        local = self.pending
        self._samples = self._tokens = self._microbatches = 0
        if not (dist.is_available() and dist.is_initialized()):
            return local
        if device is None:
            device = "cpu" if dist.get_backend(group) == "gloo" else torch.cuda.current_device()
        counts = torch.tensor([local.samples, local.tokens, local.microbatches], dtype=torch.int64, device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
        samples, tokens, microbatches = counts.tolist()
        return StepTotals(samples, tokens, microbatches)


ACCOUNTING = ConsumedAccounting()  # the process's counters: the loader records, the train step closes


def record_microbatch(samples: int, tokens: int) -> None:
    """Loader side: count one microbatch handed to the train loop (into :data:`ACCOUNTING`)."""
    ACCOUNTING.record(samples, tokens)


def scheduler_increment(nominal: int, totals: StepTotals, sample_based: bool) -> int:
    """How far the LR scheduler advances for one step.

    Megatron's scheduler counts in samples.  With ``--train-samples`` (``sample_based``) its
    warm-up and decay lengths are sample counts the user derived from the data, so it must
    advance by the samples really consumed.  With ``--train-iters`` those lengths are
    ``iters * global_batch_size``: a schedule in steps, which advancing by ``nominal``
    (``global_batch_size``) per step keeps exact whatever a pack holds.  A step in which
    no loader recorded anything (``totals.microbatches == 0``) keeps ``nominal``.
    """
    return totals.samples if sample_based and totals.microbatches else nominal


def consumed_correction(nominal: int, totals: StepTotals) -> int:
    """What to add to ``consumed_train_samples`` on top of upstream's ``nominal`` step count
    so that it grows by the samples really consumed (0 when no loader recorded the step)."""
    return totals.samples - nominal if totals.microbatches else 0
