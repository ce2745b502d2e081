"""Images with Pillow, in the Qwen2-VL family's vision encoder layout (dynamic resolution).

The geometry comes from the job's image processor (:class:`ImageGeometry`, read by
:meth:`ImageGeometry.from_processor` from its ``preprocessor_config.json`` values): Qwen2-VL /
Qwen2.5-VL cut ``14 x 14`` patches and normalise with CLIP's mean/std (:data:`QWEN2_VL`, the
default), Qwen3-VL cuts ``16 x 16`` patches with mean/std 0.5.  An image is resized so both
sides are multiples of ``patch * merge`` with its area inside ``[min_pixels, max_pixels]``
and its aspect ratio nearly kept, normalised with the processor's mean/std, repeated
``temporal_patch`` times along time and cut into ``patch x patch`` patches.  Rows of the
result are patches, ordered so that the ``merge x merge`` patches that the projector merges
into one LLM token are consecutive; a row holds ``C * T * P * P`` values (1176 for Qwen2-VL,
1536 for Qwen3-VL).  The grid ``(t, h, w)`` counts patches before the merge, so the image
stands for ``t * h * w / merge**2`` LLM tokens.

Decoded images stay ``uint8`` (the resized pixels, exactly) until a pack is joined:
:func:`normalize` turns the pack's rows into float32 in one pass.  A held or transferred
sample thus takes a quarter of the memory, which matters because the online packer keeps
up to ``window`` packs of decoded samples.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from .errors import BadImage, ProcessorConfigError

PATCH = 14
MERGE = 2
TEMPORAL_PATCH = 2
CHANNELS = 3
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 262144  # MindSpeed-MM's examples/qwen2.5vl/data_*.json image_max_pixels
PREPROCESSOR_FILE = "preprocessor_config.json"


@dataclass(frozen=True)
class ImageGeometry:
    """How a vision encoder of the Qwen2-VL family wants its images: patch side, spatial
    merge, temporal patch, per-channel mean/std and the dynamic-resolution pixel bounds."""

    patch: int = PATCH
    merge: int = MERGE
    temporal_patch: int = TEMPORAL_PATCH
    mean: tuple[float, ...] = tuple(float(v) for v in MEAN)
    std: tuple[float, ...] = tuple(float(v) for v in STD)
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS

    @property
    def factor(self) -> int:
        """What both sides of a resized image are multiples of."""
        return self.patch * self.merge

    @property
    def row_size(self) -> int:
        """Values in one patch row: ``C * T * P * P``."""
        return CHANNELS * self.temporal_patch * self.patch * self.patch

    def tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """LLM tokens an image of patch grid ``(t, h, w)`` stands for."""
        t, h, w = grid_thw
        return t * h * w // (self.merge * self.merge)

    @classmethod
    def from_processor(cls, image_processor: Any, where: str = PREPROCESSOR_FILE) -> "ImageGeometry":
        """The geometry an HF image processor (``Qwen2VLImageProcessor`` and its kin) was
        configured with: ``patch_size``, ``merge_size``, ``temporal_patch_size``,
        ``image_mean``, ``image_std`` and ``min_pixels`` / ``max_pixels`` (or the ``size``
        dict's ``shortest_edge`` / ``longest_edge``, which newer processors keep instead).
        ``where`` names the processor's files in the error raised for a missing value
        (:class:`~.errors.ProcessorConfigError`: a loader cannot guess a model's patches)."""
        size = getattr(image_processor, "size", None) or {}

        def value(key: str, fallback_key: str | None = None) -> Any:
            found = getattr(image_processor, key, None)
            if found is None and fallback_key is not None and isinstance(size, dict):
                found = size.get(fallback_key)
            if found is None:
                also = f" (or size.{fallback_key})" if fallback_key else ""
                raise ProcessorConfigError(
                    f"{where}: the image processor ({type(image_processor).__name__}) has no {key!r}{also}: the "
                    f"packing loader cuts images with the processor's own {key} and cannot guess it")
            return found

        # float32 as they are applied (so CLIP's values give :data:`QWEN2_VL` exactly)
        mean, std = (tuple(float(np.float32(v)) for v in value(key)) for key in ("image_mean", "image_std"))
        for key, values in (("image_mean", mean), ("image_std", std)):
            if len(values) != CHANNELS:
                raise ProcessorConfigError(f"{where}: {key} must have {CHANNELS} values (RGB), got {list(values)}")
        return cls(int(value("patch_size")), int(value("merge_size")), int(value("temporal_patch_size")), mean, std,
                   int(value("min_pixels", "shortest_edge")), int(value("max_pixels", "longest_edge")))


QWEN2_VL = ImageGeometry()


def resized_size(height: int, width: int, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
                 factor: int = PATCH * MERGE) -> tuple[int, int]:
    """``(height, width)`` after dynamic-resolution resizing: multiples of ``factor``,
    area within ``[min_pixels, max_pixels]``, aspect ratio kept as far as rounding allows."""
    if min(height, width) < 1:
        raise ValueError(f"image of size {width}x{height} has no pixels")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of size {width}x{height}: aspect ratio above 200")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        scale = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / scale / factor) * factor)
        w = max(factor, math.floor(width / scale / factor) * factor)
    elif h * w < min_pixels:
        scale = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * scale / factor) * factor
        w = math.ceil(width * scale / factor) * factor
    return h, w


def load_image(path: str, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS,
               geometry: ImageGeometry = QWEN2_VL) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``(pixels [t*h*w, C*T*P*P] uint8, (t, h, w))`` of one image file cut in ``geometry``'s
    patches (:func:`normalize` them); the pixel bounds are ``min_pixels`` / ``max_pixels``.

    Raises :class:`BadImage` with kind ``missing_image`` or ``corrupt_image``."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            img.load()
            rgb = img.convert("RGB")
    except FileNotFoundError:
        raise BadImage("missing_image", f"image {path} does not exist") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise BadImage("corrupt_image", f"image {path} cannot be decoded ({e})") from None
    try:
        h, w = resized_size(rgb.height, rgb.width, min_pixels, max_pixels, geometry.factor)
    except ValueError as e:
        raise BadImage("corrupt_image", f"image {path}: {e}") from None
    return patchify(np.asarray(rgb.resize((w, h), Image.BICUBIC), dtype=np.uint8), geometry)


@functools.lru_cache(maxsize=None)
def _column_affine(geometry: ImageGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-column ``scale, offset`` with ``(u8 / 255 - mean[c]) / std[c] == u8 * scale + offset``;
    column ``j`` of a row belongs to channel ``j // (T * P * P)``."""
    channel = np.arange(geometry.row_size) // (geometry.temporal_patch * geometry.patch * geometry.patch)
    mean, std = np.asarray(geometry.mean, dtype=np.float32), np.asarray(geometry.std, dtype=np.float32)
    return torch.from_numpy(1.0 / (255.0 * std[channel])), torch.from_numpy(-mean[channel] / std[channel])


def normalize(rows: torch.Tensor, geometry: ImageGeometry = QWEN2_VL) -> torch.Tensor:
    """uint8 patch rows -> the float32 ``pixel_values`` the vision encoder takes (``geometry``'s mean/std)."""
    scale, offset = _column_affine(geometry)
    return torch.addcmul(offset, rows, scale)  # one pass: uint8 is promoted on the fly


def normalize_joined(parts: Sequence[torch.Tensor], geometry: ImageGeometry = QWEN2_VL) -> torch.Tensor:
    """``normalize(torch.cat(parts), geometry)`` without the uint8 concatenation: each part is
    normalised straight into its rows of one float32 buffer.  The join of a pack is the
    loader's main-process work; the intermediate ``cat`` (a fresh buffer, page faults and a
    copy) cost as much as the normalisation itself.  Bit-identical: the same kernel runs row
    by row either way (the columns broadcast)."""
    scale, offset = _column_affine(geometry)
    out = torch.empty((sum(p.shape[0] for p in parts), scale.numel()), dtype=torch.float32)
    start = 0
    for part in parts:
        if part.shape[0]:
            torch.addcmul(offset, part, scale, out=out[start:start + part.shape[0]])
        start += part.shape[0]
    return out


def patchify(image: np.ndarray, geometry: ImageGeometry = QWEN2_VL) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``[H, W, C]`` image -> ``([t*h*w, C*T*P*P], (t, h, w))`` in merge order (any dtype)."""
    height, width, channels = image.shape
    p, m, tp = geometry.patch, geometry.merge, geometry.temporal_patch
    gh, gw = height // p, width // p
    frames = np.repeat(image.transpose(2, 0, 1)[None], tp, axis=0)  # [T, C, H, W]
    grid = frames.reshape(1, tp, channels, gh // m, m, p, gw // m, m, p)
    # -> [t, h/m, w/m, m_h, m_w, C, T, P, P]: merge groups consecutive, each row C*T*P*P
    rows = grid.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gh * gw, channels * tp * p * p)
    return np.ascontiguousarray(rows), (1, gh, gw)
