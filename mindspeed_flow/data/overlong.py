"""Samples longer than a pack: the loader's ``overlong`` policy, image-aware.

The packer's own split/truncate work on lengths only; a multimodal sample cannot be cut
inside an image's token run (the model pairs every image token with a ViT output), so the
loader cuts samples itself and hands the packer pieces that fit:

- ``"split"``: consecutive chunks of at most ``capacity`` tokens, each cut moved back to
  just before the image run it would cut; every chunk keeps its own images and its
  slice of the sample's M-RoPE ids (positions continue, they do not restart), and its
  first label is masked like any segment's.
- ``"truncate"``: the first chunk only.
- ``"drop"``: nothing.
- ``"error"``: the loader fails.

An image run longer than ``capacity`` cannot be placed at all: such a sample is handled as
``"drop"`` under ``"split"``/``"truncate"`` (and counted), as an error under ``"error"``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch

from .decode import Sample

OverlongPolicy = Literal["split", "truncate", "drop", "error"]
POLICIES = ("split", "truncate", "drop", "error")


def image_runs(sample: Sample, image_token_id: int) -> list[tuple[int, int]]:
    """``(start, end)`` token ranges of each image's token run, in order."""
    is_image = (sample.input_ids == image_token_id).to(torch.int8)
    edges = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int8), is_image, torch.zeros(1, dtype=torch.int8)]))
    starts = torch.nonzero(edges == 1).flatten().tolist()
    ends = torch.nonzero(edges == -1).flatten().tolist()
    return list(zip(starts, ends))


def cut_points(length: int, runs: list[tuple[int, int]], capacity: int) -> list[int] | None:
    """Chunk boundaries ``[0, ..., length]`` with chunks <= capacity, none inside a run;
    None when some run alone exceeds ``capacity``."""
    if any(end - start > capacity for start, end in runs):
        return None
    cuts = [0]
    while length - cuts[-1] > capacity:
        cut = cuts[-1] + capacity
        for start, end in runs:
            if start < cut < end:
                cut = start  # > cuts[-1]: the run is <= capacity, so it did not start the chunk
                break
        cuts.append(cut)
    cuts.append(length)
    return cuts


def split_sample(sample: Sample, cuts: list[int], image_token_id: int, merge: int = 2) -> list[Sample]:
    """The chunks of ``sample`` between consecutive ``cuts``, each with its own images."""
    tokens_per_image = (sample.image_grid_thw.prod(dim=1) // (merge * merge)).tolist()
    patches_per_image = sample.image_grid_thw.prod(dim=1).tolist()
    runs = image_runs(sample, image_token_id)
    chunks = []
    image = patch = 0
    for k, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
        first_image = image
        while image < len(runs) and runs[image][0] < hi:
            image += 1
        n_patches = sum(patches_per_image[first_image:image])
        assert sum(tokens_per_image[first_image:image]) == sum(e - s for s, e in runs[first_image:image])
        chunks.append(replace(
            sample, chunk=k, sample_id=f"{sample.sample_id}#{k}/{len(cuts) - 1}",
            input_ids=sample.input_ids[lo:hi], labels=sample.labels[lo:hi],
            position_ids=sample.position_ids[:, lo:hi],
            pixel_values=sample.pixel_values[patch:patch + n_patches],
            image_grid_thw=sample.image_grid_thw[first_image:image],
        ))
        patch += n_patches
    return chunks


def fit(sample: Sample, capacity: int, policy: OverlongPolicy, image_token_id: int,
        merge: int = 2) -> list[Sample] | None:
    """The pieces of ``sample`` to pack under ``policy``; ``[sample]`` when it fits, None
    when the policy (or an image run over ``capacity``) leaves nothing to pack.
    ``"error"`` is the caller's to raise (it names the place)."""
    if len(sample) <= capacity:
        return [sample]
    if policy in ("drop", "error"):
        return None
    cuts = cut_points(len(sample), image_runs(sample, image_token_id), capacity)
    if cuts is None:
        return None
    chunks = split_sample(sample, cuts, image_token_id, merge)
    return chunks if policy == "split" else chunks[:1]
