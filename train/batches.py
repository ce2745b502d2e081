"""What one microbatch of the tiny VLM is, in the two layouts the main job compares.

The loader yields *packs* (:func:`mindspeed_flow.data.batch.collate_pack`): samples laid end
to end in one ``[1, T]`` row with their boundaries in ``cu_seqlens``.  FlowTrain feeds a pack
as it is (varlen attention over the boundaries); the MindSpeed-MM style baseline feeds the
same samples one per row, padded to the longest of the microbatch, under a dense mask.
:class:`ModelBatch` holds either, so the model, the loss and the report see one type.

Labels follow the loader: ``-100`` marks a token without loss and the first token of every
sample is ``-100``.  The model predicts token ``i + 1`` at position ``i``; shifting a pack's
row by one is therefore the same as shifting each sample on its own, because the target
that would cross a boundary is a sample's first label, which is ``-100``
(:meth:`ModelBatch.next_token_labels`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from mindspeed_flow.data.conversation import IGNORE
from mindspeed_flow.data.images import MERGE

ATTENTION_KINDS = ("varlen", "dense")
TENSOR_FIELDS = ("input_ids", "labels", "position_ids", "pixel_values", "image_grid_thw", "segments")
PAD_TOKEN = 0  # any valid id: padded positions are masked out of attention and loss


@dataclass
class ModelBatch:
    """One microbatch, the argument of every model forward of the main job.

    Attributes:
        input_ids, labels, position_ids: ``[B, S]``; a pack is one row (``B == 1``), a
            padded microbatch one sample per row.  Positions restart at 0 at every sample
            start, so RoPE sees each sample alone in both layouts.
        pixel_values: ``[N, 1176]`` patch rows of the microbatch's images, in token order.
        image_grid_thw: ``[I, 3]`` patch grid of each image.
        segments: cu_seqlens of the real tokens, flattened (leading 0, ``int32``): a pack's
            own, or each padded row's real length in turn.
        attention: ``"varlen"`` (packed THD, segment boundaries) or ``"dense"`` (an explicit
            ``[B, 1, S, S]`` mask).
        loss_tokens: the step's global loss denominator (``StepData.loss_tokens``).
        sample_ids: the samples, in order.
        padded_tokens: ``B * S``, what is computed (against ``segments[-1]`` real tokens).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    segments: torch.Tensor
    attention: str
    loss_tokens: int
    sample_ids: list[str]
    padded_tokens: int

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"ModelBatch: attention must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.attention == "varlen" and self.input_ids.shape[0] != 1:
            raise ValueError(f"ModelBatch: varlen attention takes one packed row, got {self.input_ids.shape[0]} "
                             f"rows (samples {self.sample_ids})")
        if self.loss_tokens < 1:
            raise ValueError(f"ModelBatch: loss_tokens must be >= 1 (the step's loss denominator), got "
                             f"{self.loss_tokens} (samples {self.sample_ids})")

    def to(self, device: torch.device | str) -> "ModelBatch":
        """A copy with every tensor on ``device`` (the loader yields CPU tensors)."""
        return replace(self, **{name: getattr(self, name).to(device) for name in TENSOR_FIELDS})

    @property
    def real_tokens(self) -> int:
        return int(self.segments[-1])

    def next_token_labels(self) -> torch.Tensor:
        """``[B, S]`` target of each position: the label of the next token of the same row,
        ``-100`` past the row's end (see the module docstring for why this is per sample)."""
        ignore = torch.full_like(self.labels[:, :1], IGNORE)
        return torch.cat([self.labels[:, 1:], ignore], dim=1)

    def row_segments(self) -> list[list[int]]:
        """Each row's sample lengths: a pack's samples all sit in row 0; a padded
        microbatch has one sample per row (a one-row padded microbatch is both)."""
        lengths = self.segments.diff().tolist()
        if self.input_ids.shape[0] == 1:
            return [lengths]
        return [[n] for n in lengths]

    def dense_mask(self) -> torch.Tensor:
        """``[B, 1, S, S]`` bool, Megatron's convention (``True`` = masked out): a query sees
        a key when the key is not later, in the same sample, and not padding."""
        (rows, seq), device = self.input_ids.shape, self.input_ids.device
        sample = torch.full((rows, seq), -1, dtype=torch.long, device=device)  # -1: padding
        for row, lengths in enumerate(self.row_segments()):
            sample[row, :sum(lengths)] = torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                                                 torch.tensor(lengths, device=device))
        same = (sample[:, :, None] == sample[:, None, :]) & (sample[:, None, :] >= 0)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
        return ~(same & causal).unsqueeze(1)


def count_loss_tokens(packs: Sequence[dict[str, Any]]) -> int:
    """Positions of ``packs`` whose next label is not ``-100``: the step's loss denominator."""
    return sum(int((pack["labels"][:, 1:] != IGNORE).sum()) for pack in packs)


def from_pack(pack: dict[str, Any], loss_tokens: int, attention: str) -> ModelBatch:
    """A loader pack as one microbatch: varlen (FlowTrain) or dense block-diagonal (the
    baseline in parity mode).  Positions restart at every sample start."""
    segments = pack["cu_seqlens"].to(torch.int32)
    return ModelBatch(
        input_ids=pack["input_ids"], labels=pack["labels"], position_ids=_restarting_positions(segments)[None],
        pixel_values=pack["pixel_values"], image_grid_thw=pack["image_grid_thw"].reshape(-1, 3),
        segments=segments, attention=attention, loss_tokens=loss_tokens, sample_ids=list(pack["sample_ids"]),
        padded_tokens=int(pack["input_ids"].numel()),
    )


@dataclass
class PackSample:
    """One sample cut out of a pack, with the image rows that belong to its tokens."""

    sample_id: str
    input_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


def padded_microbatches(packs: Sequence[dict[str, Any]], micro_batch_size: int, loss_tokens: int, *,
                        image_token_id: int) -> list[ModelBatch]:
    """The same samples as ``packs``, in the same order, ``micro_batch_size`` per
    microbatch, one per row padded to the longest of its microbatch (MindSpeed-MM's layout),
    dense attention.  A sample's image rows travel with it: ``image_token_id`` tells which of
    its tokens stand for image patches (``t*h*w/4`` merged tokens per image)."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    samples = [s for pack in packs for s in split_pack(pack, image_token_id)]
    return [_pad(samples[i:i + micro_batch_size], loss_tokens) for i in range(0, len(samples), micro_batch_size)]


def split_pack(pack: dict[str, Any], image_token_id: int) -> list[PackSample]:
    """The pack's samples in order, each with its own image rows and grids
    (``image_token_id`` says which tokens stand for image patches)."""
    starts = pack["cu_seqlens"].tolist()
    grids = pack["image_grid_thw"].reshape(-1, 3)
    merged_tokens = (grids.prod(dim=1) // (MERGE * MERGE)).tolist()
    patches = grids.prod(dim=1).tolist()
    image = row = 0
    samples = []
    for sample_id, start, end in zip(pack["sample_ids"], starts[:-1], starts[1:]):
        ids = pack["input_ids"][0, start:end]
        wanted = int((ids == image_token_id).sum())
        first_image, first_row = image, row
        while wanted > 0 and image < len(merged_tokens):
            wanted -= merged_tokens[image]
            row += patches[image]
            image += 1
        if wanted != 0:
            raise ValueError(
                f"sample {sample_id}: its {int((ids == image_token_id).sum())} image tokens (id {image_token_id}) do "
                f"not match whole images of the pack's image_grid_thw from image {first_image} on")
        samples.append(PackSample(sample_id, ids, pack["labels"][0, start:end], pack["pixel_values"][first_row:row],
                               grids[first_image:image]))
    if image != len(merged_tokens):
        raise ValueError(f"pack {pack['sample_ids']}: {len(merged_tokens) - image} images are left over after its "
                         f"samples' image tokens (id {image_token_id})")
    return samples


def _pad(samples: list[PackSample], loss_tokens: int) -> ModelBatch:
    lengths = [len(s.input_ids) for s in samples]
    seq, device = max(lengths), samples[0].input_ids.device
    input_ids = torch.full((len(samples), seq), PAD_TOKEN, dtype=torch.long, device=device)
    labels = torch.full((len(samples), seq), IGNORE, dtype=torch.long, device=device)
    positions = torch.zeros((len(samples), seq), dtype=torch.long, device=device)
    for row, (sample, n) in enumerate(zip(samples, lengths)):
        input_ids[row, :n], labels[row, :n] = sample.input_ids, sample.labels
        positions[row, :n] = torch.arange(n, device=device)
    return ModelBatch(
        input_ids=input_ids, labels=labels, position_ids=positions,
        pixel_values=torch.cat([s.pixel_values for s in samples]),
        image_grid_thw=torch.cat([s.image_grid_thw for s in samples]).reshape(-1, 3),
        segments=torch.tensor([0] + lengths, device=device).cumsum(0).to(torch.int32),
        attention="dense", loss_tokens=loss_tokens, sample_ids=[s.sample_id for s in samples],
        padded_tokens=len(samples) * seq,
    )


def join_samples(samples: Sequence[PackSample], loss_tokens: int) -> ModelBatch:
    """``samples`` end to end in one packed row, varlen attention: the microbatch the flow's
    backbone packs after encoding (its image rows in the same order as its image tokens)."""
    segments = torch.tensor([0] + [len(s.input_ids) for s in samples]).cumsum(0).to(torch.int32)
    segments = segments.to(samples[0].input_ids.device)
    return ModelBatch(
        input_ids=torch.cat([s.input_ids for s in samples])[None], labels=torch.cat([s.labels for s in samples])[None],
        position_ids=_restarting_positions(segments)[None], pixel_values=torch.cat([s.pixel_values for s in samples]),
        image_grid_thw=torch.cat([s.image_grid_thw for s in samples]).reshape(-1, 3), segments=segments,
        attention="varlen", loss_tokens=loss_tokens, sample_ids=[s.sample_id for s in samples],
        padded_tokens=int(segments[-1]),
    )


def _restarting_positions(segments: torch.Tensor) -> torch.Tensor:
    """``[T]`` position of every token within its own sample."""
    lengths = segments.diff().long()
    starts = torch.repeat_interleave(segments[:-1].long(), lengths)
    return torch.arange(int(segments[-1]), device=segments.device) - starts
