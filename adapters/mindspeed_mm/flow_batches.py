"""MindSpeed-MM's microbatches cut into the flow's samples (the decoupled layout's ``flow: true``).

Under the flow, an encoder rank encodes a step's samples in batches of its own
(:func:`mindspeed_flow.flow.packed.group_packed`) and puts one pool entry per sample; the
backbone keeps the loader's microbatches and takes each one's samples' embeddings by key.
Both sides read the same microbatches (the plugin's loader hands every rank of a slice its
first stage's packs), so both cut them into the same samples here:

- a *sample* is a ``cu_seqlens`` segment of a packed batch (the packing loader's; its
  ``sample_ids`` count the real segments, padding is the last one), or a row of an unpacked
  one (upstream's collator, a test's single-sample batches);
- its images are the next ones of the batch's ``image_grid_thw`` whose image tokens
  (``t*h*w`` patches over the merger's ``patches / tokens``) add up to the image tokens
  (``img_context_token_id``) in its segment; their ``pixel_values`` rows follow in order.

:meth:`StepBatches.encoder_input` joins a batch of samples into the input MindSpeed-MM's
``forward_step`` takes (``input_ids`` of the samples end to end, their ``pixel_values`` and
``image_grid_thw``): the encoder rank's ``VLMModel`` runs its ViT + projector on it and
returns the image embeddings, the samples' rows end to end.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from mindspeed_flow.flow import SampleMeta
from mindspeed_flow.flow.errors import SampleError


class StepBatches:
    """One step's microbatches as the flow sees them.

    Attributes:
        step: the flow's step number (every rank of the slice counts the same).
        batches: the microbatches, as the loader handed them.
        metas: every sample of the step (sample id: its index in the step).
        microbatches: each microbatch's sample ids, in order.
    """

    def __init__(self, step: int, batches: Sequence[dict], image_token_id: int) -> None:
        self.step = step
        self.batches = list(batches)
        self.metas: list[SampleMeta] = []
        self.microbatches: list[tuple[int, ...]] = []
        self._parts: dict[int, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = {}
        for m, batch in enumerate(self.batches):
            self.microbatches.append(tuple(self._cut(m, batch, image_token_id)))

    def encoder_input(self, metas: Sequence[SampleMeta]) -> dict[str, Any]:
        """The encoder's input for these samples (see the module)."""
        ids, pixels, grids = zip(*(self._parts[m.sample_id] for m in metas))
        with_images = [i for i, p in enumerate(pixels) if p is not None]
        return {"input_ids": torch.cat(ids).unsqueeze(0),
                "pixel_values": torch.cat([pixels[i] for i in with_images]),
                "image_grid_thw": torch.cat([grids[i] for i in with_images])}

    def _cut(self, m: int, batch: dict, image_token_id: int) -> list[int]:
        """Batch ``m``'s samples added to the step; their ids."""
        if "pixel_values_videos" in batch:
            raise SampleError(f"flow step {self.step} microbatch {m}: video input is not carried by the flow "
                              "(image embeddings only)")
        input_ids = batch["input_ids"]
        segments = _segments(batch, m)
        tokens = [int((input_ids[row, start:end] == image_token_id).sum()) for row, start, end in segments]
        grid = batch.get("image_grid_thw")
        patches = [] if grid is None or batch.get("pixel_values") is None else \
            [int(p) for p in torch.as_tensor(grid).reshape(-1, 3).prod(dim=1)]
        unit = _patches_per_token(patches, sum(tokens), self.step, m)
        image, row_start, ids = 0, 0, []
        for (row, start, end), count in zip(segments, tokens):
            first, need = image, count
            while need > 0 and image < len(patches):
                need -= patches[image] // unit
                image += 1
            if need != 0:
                raise SampleError(f"flow step {self.step} microbatch {m}: the sample at tokens {start}..{end} has "
                                  f"{count} image tokens, which its batch's next images "
                                  f"{patches[first:image]} (patches, {unit} per token) do not add up to")
            rows = sum(patches[first:image])
            sample_id = len(self.metas)
            self.metas.append(SampleMeta(sample_id, self.step, end - start, count, tuple(patches[first:image])))
            self._parts[sample_id] = (
                input_ids[row, start:end],
                batch["pixel_values"][row_start:row_start + rows] if image > first else None,
                torch.as_tensor(grid).reshape(-1, 3)[first:image] if image > first else None)
            row_start += rows
            ids.append(sample_id)
        if image != len(patches):
            raise SampleError(f"flow step {self.step} microbatch {m}: {len(patches) - image} of its images belong to "
                              "no sample (more images than image tokens)")
        return ids


def _segments(batch: dict, m: int) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of each sample of a batch: ``cu_seqlens`` segments (the real
    ones: ``sample_ids`` counts them) of a one-row packed batch, else each row's real tokens."""
    input_ids = batch["input_ids"]
    if batch.get("cu_seqlens") is not None:
        cu = [int(c) for c in torch.as_tensor(batch["cu_seqlens"]).flatten()]
        count = len(batch["sample_ids"]) if batch.get("sample_ids") is not None else len(cu) - 1
        if input_ids.shape[0] != 1 or count > len(cu) - 1:
            raise SampleError(f"flow microbatch {m}: a packed batch of shape {tuple(input_ids.shape)} with "
                              f"cu_seqlens {cu} cannot hold {count} samples in one row")
        return [(0, cu[i], cu[i + 1]) for i in range(count)]
    mask = batch.get("attention_mask")
    lengths = [int(mask[row].sum()) if mask is not None else input_ids.shape[1] for row in range(input_ids.shape[0])]
    return [(row, 0, length) for row, length in enumerate(lengths)]


def _patches_per_token(patches: list[int], tokens: int, step: int, m: int) -> int:
    """ViT patches per image token (the merger's window, 4 for Qwen2.5-VL), from the batch's totals."""
    if not patches and not tokens:
        return 1
    if not tokens or sum(patches) % tokens:
        raise SampleError(f"flow step {step} microbatch {m}: {sum(patches)} image patches do not make "
                          f"{tokens} image tokens")
    return sum(patches) // tokens
