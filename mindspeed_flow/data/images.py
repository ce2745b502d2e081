"""Images with Pillow, in the Qwen2-VL vision encoder's layout (dynamic resolution).

An image is resized so both sides are multiples of ``patch * merge`` (28) with its area
inside ``[min_pixels, max_pixels]`` and its aspect ratio nearly kept, normalised with the
CLIP mean/std, repeated twice along time (``temporal_patch = 2``) and cut into
``14 x 14`` patches.  Rows of the result are patches, ordered so that the ``merge x merge``
patches that the projector merges into one LLM token are consecutive; a row holds
``C * T * P * P = 3 * 2 * 14 * 14 = 1176`` values.  The grid ``(t, h, w)`` counts patches
before the merge, so the image stands for ``t * h * w / merge**2`` LLM tokens.

Decoded images stay ``uint8`` (the resized pixels, exactly) until a pack is joined:
:func:`normalize` turns the pack's rows into float32 in one pass.  A held or transferred
sample thus takes a quarter of the memory, which matters because the online packer keeps
up to ``window`` packs of decoded samples.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from .errors import BadImage

PATCH = 14
MERGE = 2
TEMPORAL_PATCH = 2
MEAN = np.array([0.48145466, 0.4578275, 0.40821073], dtype=np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], dtype=np.float32)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 262144  # MindSpeed-MM's examples/qwen2.5vl/data_*.json image_max_pixels


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


def load_image(path: str, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``(pixels [t*h*w, 1176] uint8, (t, h, w))`` of one image file (:func:`normalize` them).

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
        h, w = resized_size(rgb.height, rgb.width, min_pixels, max_pixels)
    except ValueError as e:
        raise BadImage("corrupt_image", f"image {path}: {e}") from None
    return patchify(np.asarray(rgb.resize((w, h), Image.BICUBIC), dtype=np.uint8))


def _column_affine() -> tuple[torch.Tensor, torch.Tensor]:
    """Per-column ``scale, offset`` with ``(u8 / 255 - mean[c]) / std[c] == u8 * scale + offset``;
    column ``j`` of a row belongs to channel ``j // (T * P * P)``."""
    channel = np.arange(3 * TEMPORAL_PATCH * PATCH * PATCH) // (TEMPORAL_PATCH * PATCH * PATCH)
    return torch.from_numpy(1.0 / (255.0 * STD[channel])), torch.from_numpy(-MEAN[channel] / STD[channel])


_SCALE, _OFFSET = _column_affine()


def normalize(rows: torch.Tensor) -> torch.Tensor:
    """uint8 patch rows -> the float32 ``pixel_values`` the vision encoder takes (CLIP mean/std)."""
    return torch.addcmul(_OFFSET, rows, _SCALE)  # one pass: uint8 is promoted on the fly


def normalize_joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``normalize(torch.cat(parts))`` without the uint8 concatenation: each part is
    normalised straight into its rows of one float32 buffer.  The join of a pack is the
    loader's main-process work; the intermediate ``cat`` (a fresh buffer, page faults and a
    copy) cost as much as the normalisation itself.  Bit-identical: the same kernel runs row
    by row either way (rows of 1176 values, the columns broadcast)."""
    out = torch.empty((sum(p.shape[0] for p in parts), _SCALE.numel()), dtype=torch.float32)
    start = 0
    for part in parts:
        if part.shape[0]:
            torch.addcmul(_OFFSET, part, _SCALE, out=out[start:start + part.shape[0]])
        start += part.shape[0]
    return out


def patchify(image: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
    """``[H, W, C]`` image -> ``([t*h*w, C*T*P*P], (t, h, w))`` in merge order (any dtype)."""
    height, width, channels = image.shape
    gh, gw = height // PATCH, width // PATCH
    frames = np.repeat(image.transpose(2, 0, 1)[None], TEMPORAL_PATCH, axis=0)  # [T, C, H, W]
    grid = frames.reshape(1, TEMPORAL_PATCH, channels, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    # -> [t, h/m, w/m, m_h, m_w, C, T, P, P]: merge groups consecutive, each row C*T*P*P
    rows = grid.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(gh * gw, channels * TEMPORAL_PATCH * PATCH * PATCH)
    return np.ascontiguousarray(rows), (1, gh, gw)


def image_tokens(grid_thw: tuple[int, int, int]) -> int:
    t, h, w = grid_thw
    return t * h * w // (MERGE * MERGE)
