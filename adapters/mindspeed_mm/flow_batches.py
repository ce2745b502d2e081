"""MindSpeed-MM's microbatches cut into the flow's samples (the decoupled layout's ``flow: true``).

Under the flow, an encoder rank encodes a step's samples in batches of its own
(:func:`mindspeed_flow.flow.packed.group_packed`) and puts one pool entry per sample; the
backbone keeps the loader's microbatches (or repacks them, below) and takes each one's
samples' embeddings by key.
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

:meth:`StepBatches.repack` (the layout's ``flow_repack``) makes the backbone's microbatches of
the flow's grouping instead of the loader's packs: each sample is cut out of its pack as the
loader's own :class:`~mindspeed_flow.data.decode.Sample` (its tokens, labels, M-RoPE ids,
pixel rows and image grids) and the new groups are joined by the loader's own join
(:func:`~mindspeed_flow.data.batch.join_pack`), so a regrouped pack is exactly the pack the
loader makes of those samples (its pixels were normalised when the loader joined them).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Sequence

import torch

from mindspeed_flow.data.batch import TENSOR_KEYS, join_pack
from mindspeed_flow.data.decode import Sample
from mindspeed_flow.data.loader import default_cost_model
from mindspeed_flow.flow import SampleMeta
from mindspeed_flow.flow.errors import SampleError
from mindspeed_flow.packing import CostModel

# What a packed batch of the loader's contract holds (mindspeed_flow.data.batch); a regrouped pack
# is joined from these only, so a batch with another key is not regrouped (nothing says how to cut it).
PACK_KEYS = (*TENSOR_KEYS, "sample_ids")


@dataclass(frozen=True)
class PackSettings:
    """How the job's packs are made, which a regrouped microbatch keeps to: ``capacity``
    tokens at most, the LLM's ``cost_model`` (what the packs are balanced and ordered by),
    padding to a ``multiple`` of tokens."""

    capacity: int
    cost_model: CostModel
    multiple: int = 1


def pack_settings(iterator: Any, seq_length: int) -> PackSettings:
    """The settings of the packing loader behind the job's data ``iterator`` (``--flow-packing``;
    every rank of a slice holds one, decoding or not): its capacity, cost model and pad
    multiple.  Without one (a job that hands pre-made packs) a pack holds ``seq_length``
    tokens, unpadded, costed as the loader's default (:func:`~mindspeed_flow.data.loader.default_cost_model`)."""
    from .data import flow_iterators

    found = flow_iterators(iterator)
    if found:
        loader = found[0].loader
        return PackSettings(loader.capacity, loader.cost_model, loader.pad_multiple)
    return PackSettings(seq_length, default_cost_model(seq_length))


@dataclass(frozen=True)
class _Place:
    """Where a sample lies in the step's microbatches: batch ``batch``, its ``segment``-th
    sample, row ``row``, tokens ``start..end``; its images ``images`` of the batch's grids,
    its pixel rows ``pixels``."""

    batch: int
    segment: int
    row: int
    start: int
    end: int
    images: slice
    pixels: slice


class StepBatches:
    """One step's microbatches as the flow sees them.

    Attributes:
        step: the flow's step number (every rank of the slice counts the same).
        batches: the backbone's microbatches: the loader's, or after :meth:`repack` the regrouped ones.
        loader_batches: the microbatches as the loader handed them.
        metas: every sample of the step (sample id: its index in the step).
        microbatches: each of :attr:`batches`' sample ids, in order.
        loader_microbatches: each of :attr:`loader_batches`' sample ids, in order.
        pad_id: the token the loader pads a pack with, as found in a padded pack of the step
            (``None``: no pack of the step is padded).
    """

    def __init__(self, step: int, batches: Sequence[dict], image_token_id: int) -> None:
        self.step = step
        self.loader_batches = list(batches)
        self.metas: list[SampleMeta] = []
        self.pad_id: int | None = None
        self._places: dict[int, _Place] = {}
        self.loader_microbatches = [tuple(self._cut(m, batch, image_token_id))
                                    for m, batch in enumerate(self.loader_batches)]
        self.microbatches = self.loader_microbatches
        self._joined: dict[int, dict] | None = None  # after :meth:`repack`: the microbatches joined so far
        self._packs: set[int] = set()  # the loader's batches checked to be packs (:func:`_check_pack`)
        self._multiple = 1

    @property
    def batches(self) -> list[dict]:
        """The backbone's microbatches (see :meth:`batch`)."""
        return [self.batch(m) for m in range(len(self.microbatches))]

    def batch(self, m: int) -> dict:
        """The backbone's microbatch ``m``: the loader's, or after :meth:`repack` joined on
        first use (an encoder rank, which only needs :meth:`encoder_input`, never joins one;
        a backbone replica joins only the microbatches it trains)."""
        if self._joined is None:
            return self.loader_batches[m]
        if m not in self._joined:
            self._joined[m] = self._join(m, self.microbatches[m], self._multiple, self._loader_keys)
        return self._joined[m]

    @cached_property
    def _loader_keys(self) -> set[str]:
        """Every key the step's loader batches hold (a joined pack keeps these only)."""
        return set().union(*(batch.keys() for batch in self.loader_batches))

    def encoder_input(self, metas: Sequence[SampleMeta]) -> dict[str, Any]:
        """The encoder's input for these samples (see the module)."""
        places = [self._places[m.sample_id] for m in metas]
        batches = [self.loader_batches[p.batch] for p in places]
        with_images = [(b, p) for b, p in zip(batches, places) if p.images.stop > p.images.start]
        return {"input_ids": torch.cat([b["input_ids"][p.row, p.start:p.end] for b, p in zip(batches, places)]
                                       ).unsqueeze(0),
                "pixel_values": torch.cat([b["pixel_values"][p.pixels] for b, p in with_images]),
                "image_grid_thw": torch.cat([_grid(b)[p.images] for b, p in with_images])}

    def sample(self, sample_id: int) -> Sample:
        """Sample ``sample_id`` cut out of its packed microbatch, as the loader decoded it
        (pixels already normalised); refused, naming the microbatch, when its batch is not
        one of the packing loader's contract (:data:`PACK_KEYS`, ``cu_seqlens`` and
        ``[3, 1, T]`` M-RoPE ``position_ids``)."""
        place = self._places[sample_id]
        batch = self.loader_batches[place.batch]
        if place.batch not in self._packs:
            _check_pack(batch, f"flow step {self.step} microbatch {place.batch}")
            self._packs.add(place.batch)
        positions = batch["position_ids"]
        names = batch.get("sample_ids")
        tokens = slice(place.start, place.end)
        pixels = batch.get("pixel_values")
        return Sample(index=sample_id, sample_id=names[place.segment] if names is not None else "",
                      input_ids=batch["input_ids"][0, tokens], labels=batch["labels"][0, tokens],
                      position_ids=positions[:, 0, tokens],
                      pixel_values=pixels[place.pixels] if pixels is not None else None,
                      image_grid_thw=_grid(batch)[place.images])

    def repack(self, microbatches: Sequence[Sequence[int]], multiple: int = 1) -> None:
        """Make :attr:`batches` the packs of ``microbatches`` (sample ids, in order), each joined
        from its samples (:meth:`sample`) by the loader's join, padded to a multiple of
        ``multiple`` tokens as the loader pads its packs; a pack holds the keys the step's
        batches hold (``sample_ids`` only when they have them)."""
        self.microbatches = [tuple(int(s) for s in group) for group in microbatches]
        self._joined, self._multiple = {}, multiple

    def _join(self, m: int, group: tuple[int, ...], multiple: int, keys: set) -> dict[str, Any]:
        if not group:
            raise SampleError(f"flow step {self.step}: regrouped microbatch {m} has no sample")
        samples = [self.sample(s) for s in group]
        length = sum(len(s) for s in samples)
        if length % multiple and self.pad_id is None:
            raise SampleError(f"flow step {self.step}: regrouped microbatch {m} ({length} tokens) needs padding to a "
                              f"multiple of {multiple} tokens, and no pack of the step shows the loader's pad token")
        parts = [s.pixel_values for s in samples if s.pixel_values is not None]
        pack = join_pack(samples, torch.cat(parts) if parts else None, multiple,
                         self.pad_id if self.pad_id is not None else 0)
        return {k: v for k, v in pack.items() if k in keys}

    def _cut(self, m: int, batch: dict, image_token_id: int) -> list[int]:
        """Batch ``m``'s samples added to the step; their ids."""
        if "pixel_values_videos" in batch:
            raise SampleError(f"flow step {self.step} microbatch {m}: video input is not carried by the flow "
                              "(image embeddings only)")
        input_ids = batch["input_ids"]
        segments = _segments(batch, m)
        tokens = [int((input_ids[row, start:end] == image_token_id).sum()) for row, start, end in segments]
        if batch.get("cu_seqlens") is not None and len(segments) < len(batch["cu_seqlens"]) - 1 \
                and self.pad_id is None:  # a padded pack: its last segment is the loader's pad tokens
            self.pad_id = int(input_ids[0, segments[-1][2] if segments else 0])
        patches = [] if batch.get("image_grid_thw") is None or batch.get("pixel_values") is None else \
            [int(p) for p in _grid(batch).prod(dim=1)]
        unit = _patches_per_token(patches, sum(tokens), self.step, m)
        image, row_start, ids = 0, 0, []
        for segment, ((row, start, end), count) in enumerate(zip(segments, tokens)):
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
            self._places[sample_id] = _Place(m, segment, row, start, end, slice(first, image),
                                             slice(row_start, row_start + rows))
            row_start += rows
            ids.append(sample_id)
        if image != len(patches):
            raise SampleError(f"flow step {self.step} microbatch {m}: {len(patches) - image} of its images belong to "
                              "no sample (more images than image tokens)")
        return ids


def _check_pack(batch: dict, where: str) -> None:
    """Refuse, naming ``where``, a batch that is not one of the packing loader's contract
    (:data:`PACK_KEYS`, ``cu_seqlens`` and ``[3, 1, T]`` M-RoPE ``position_ids``): nothing says
    how to cut it into samples and join them again."""
    other = sorted(set(batch) - set(PACK_KEYS))
    if other:
        raise SampleError(f"{where}: cannot regroup a batch with {other} (a pack of the packing loader holds "
                          f"{list(PACK_KEYS)} only)")
    missing = [k for k in ("cu_seqlens", "labels", "position_ids") if batch.get(k) is None]
    positions = batch.get("position_ids")
    if missing or positions.dim() != 3 or positions.shape[0] != 3 or positions.shape[1] != 1:
        raise SampleError(f"{where}: cannot regroup a batch that is not a pack of the packing loader "
                          f"(missing {missing}, position_ids "
                          f"{None if positions is None else tuple(positions.shape)}; expected cu_seqlens, "
                          "labels and [3, 1, T] M-RoPE ids)")


def _grid(batch: dict) -> torch.Tensor:
    """The batch's image grids as ``[N, 3]`` (``[0, 3]`` without any)."""
    grid = batch.get("image_grid_thw")
    if grid is None:
        return torch.zeros(0, 3, dtype=torch.int64)
    return torch.as_tensor(grid).reshape(-1, 3)


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
