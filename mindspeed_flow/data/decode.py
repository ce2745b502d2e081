"""One record -> one :class:`Sample` (tokens, labels, pixels, M-RoPE ids), or a :class:`BadSample`.

Runs in the loader's worker processes.  A bad record never raises here: it becomes a
:class:`BadSample` naming its kind, its place (``file:line``) and why, so the main process
can count it, log it and apply the policy (skip or fail) in one place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .conversation import DEFAULT_SYSTEM, check_conversation, placeholder_count, tokenize_conversation
from .errors import BadConversation, BadImage, MalformedRecord
from .images import MAX_PIXELS, MIN_PIXELS, QWEN2_VL, ImageGeometry, load_image
from .mrope import mrope_position_ids
from .source import Corpus
from .tokenizer import TextTokenizer

BAD_KINDS = ("malformed_json", "missing_image", "corrupt_image", "empty_conversation",
             "placeholder_mismatch", "overlong")


@dataclass
class Sample:
    """A decoded sample (or one chunk of a split one).  ``index``: its global record index."""

    index: int
    sample_id: str
    input_ids: torch.Tensor  # int64 [L]
    labels: torch.Tensor  # int64 [L]
    position_ids: torch.Tensor  # int64 [3, L]
    pixel_values: torch.Tensor  # uint8 [sum t*h*w, C*T*P*P]: images.normalize makes them float32
    image_grid_thw: torch.Tensor  # int64 [N, 3]
    chunk: int = 0  # which chunk of a split sample (0 when not split)

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @property
    def key(self) -> tuple[int, int]:
        return self.index, self.chunk


TENSOR_FIELDS = ("input_ids", "labels", "position_ids", "pixel_values", "image_grid_thw")


def to_wire(item: "Sample | BadSample") -> "Sample | BadSample":
    """Worker side: tensors as numpy arrays, so a sample crosses to the main process as one
    pickled message instead of one shared-memory segment per tensor (measured faster
    here, and the main process then joins ordinary memory, not freshly mapped pages)."""
    if isinstance(item, BadSample):
        return item
    return replace(item, **{f: getattr(item, f).numpy() for f in TENSOR_FIELDS})


def from_wire(item: "Sample | BadSample") -> "Sample | BadSample":
    """Main side: the inverse of :func:`to_wire` (no copy)."""
    if isinstance(item, BadSample) or torch.is_tensor(item.input_ids):
        return item
    return replace(item, **{f: torch.from_numpy(getattr(item, f)) for f in TENSOR_FIELDS})


@dataclass
class BadSample:
    index: int
    sample_id: str
    kind: str
    reason: str


@dataclass
class Decoder:
    """Everything a worker needs to decode a record by its global index (picklable)."""

    corpus: Corpus
    tokenizer: TextTokenizer
    image_root: Path | None = None
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    geometry: ImageGeometry = QWEN2_VL  # the processor's patches and mean/std (its pixel bounds: the two above)
    default_system: str | None = DEFAULT_SYSTEM  # the chat template's (conversation.template_system)
    _image_token_id: int = field(init=False)

    def __post_init__(self) -> None:
        self._image_token_id = self.tokenizer.special.image_pad

    def __call__(self, index: int) -> Sample | BadSample:
        place = self.corpus.place(index)
        try:
            return self._decode(index, place)
        except Exception as e:  # not a known kind of bad input: still say which record
            raise RuntimeError(f"{place}: cannot decode this record ({type(e).__name__}: {e})") from e

    def _decode(self, index: int, place: str) -> Sample | BadSample:
        try:
            record = self.corpus.read(index)
            messages = check_conversation(record)
            paths = _image_paths(record)
            placeholders = placeholder_count(record)
            if placeholders != len(paths):
                raise BadConversation("placeholder_mismatch",
                                      f"{placeholders} <image> placeholder(s) for {len(paths)} image(s)")
            root = self.image_root if self.image_root is not None else self._shard_dir(index)
            pixels, grids = [], []
            for p in paths:
                values, grid = load_image(str(self._image_path(root, p)), self.min_pixels, self.max_pixels,
                                          self.geometry)
                pixels.append(values)
                grids.append(grid)
        except MalformedRecord as e:
            return BadSample(index, place, "malformed_json", e.reason)  # the report names the place
        except (BadConversation, BadImage) as e:
            return BadSample(index, place, e.kind, str(e))
        ids, labels = tokenize_conversation(messages, [self.geometry.tokens(g) for g in grids], self.tokenizer,
                                            system=record.get("system") or self.default_system)
        input_ids = torch.tensor(ids, dtype=torch.int64)
        needed = sum(self.geometry.tokens(g) for g in grids)
        found = int((input_ids == self._image_token_id).sum())
        if found != needed:  # the text spelled out image tokens itself (e.g. a literal <|image_pad|>)
            return BadSample(index, place, "placeholder_mismatch",
                             f"{found} image pad token(s) after tokenization where the images need {needed}")
        grid_thw = torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)
        sp = self.tokenizer.special
        position_ids = mrope_position_ids(input_ids, grid_thw if len(grids) else None,
                                          image_token_id=sp.image_pad, vision_start_token_id=sp.vision_start,
                                          spatial_merge_size=self.geometry.merge)
        pixel_values = (torch.from_numpy(np.concatenate(pixels)) if pixels
                        else torch.zeros(0, self.geometry.row_size, dtype=torch.uint8))
        return Sample(index, place, input_ids, torch.tensor(labels, dtype=torch.int64), position_ids,
                      pixel_values, grid_thw)

    def _image_path(self, root: Path, path: str) -> Path:
        """``root / path``; with an ``image_root`` (MindSpeed-MM's ``dataset_dir``) whose join
        does not exist, the path as written (absolute, or relative to the working directory),
        which is how MindSpeed-MM's converter resolves media; a missing image names the join."""
        joined = root / path
        if self.image_root is not None and not joined.is_file() and Path(path).is_file():
            return Path(path)
        return joined

    def _shard_dir(self, index: int) -> Path:
        return self.corpus.locate(index)[0].path.parent


def _image_paths(record: dict[str, Any]) -> list[str]:
    images = record.get("images") or []
    if isinstance(images, str):
        images = [images]
    if not isinstance(images, list) or not all(isinstance(p, (str, os.PathLike)) for p in images):
        raise BadConversation("placeholder_mismatch", f"'images' must be a list of paths, got {images!r}")
    return [str(p) for p in images]
