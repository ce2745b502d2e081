"""Seeded synthetic VLM workloads: per-sample token lengths and per-image patch counts.

A workload spec is a plain dict (``configs/workloads/*.yaml`` holds the shipped ones and
says why each distribution was chosen).  Shape of a spec::

    name: doc_vqa
    components:                  # a mixture; each sample draws one component by weight
      - weight: 0.7
        text_tokens: {dist: lognormal, median: 80, sigma: 0.9, min: 8, max: 3000}
        template_tokens: 12      # chat template, image/video placeholder tokens
        images:                  # optional; one entry per image of the sample
          count: {dist: const, value: 1}
          width: {dist: lognormal, median: 1700, sigma: 0.3}
          aspect: {dist: lognormal, median: 1.29, sigma: 0.08}   # height / width
          max_pixels: 3211264
        video:                   # optional; one video per sample
          frames: {dist: lognormal, median: 32, sigma: 0.7, min: 4, max: 256}
          width: ...; aspect: ...; max_pixels: ...

Vision tokens follow Qwen2-VL: the image is resized to multiples of 28 px within
``[min_pixels, max_pixels]`` keeping the aspect ratio, then gives (H/28)*(W/28) tokens;
a video gives that per pair of frames.  The encoder sees 4 patches (14x14 px) per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

FACTOR = 28  # pixels per vision token side: 14 px patches merged 2x2
PATCHES_PER_TOKEN = 4
DEFAULT_MIN_PIXELS = 4 * FACTOR * FACTOR


@dataclass
class Workload:
    """``lengths[i]``: tokens of sample i (text + vision); its images' patch counts are
    ``image_patches[image_offsets[i]:image_offsets[i + 1]]`` (a video counts as one)."""

    name: str
    lengths: np.ndarray
    image_patches: np.ndarray
    image_offsets: np.ndarray


def sample(spec: Mapping[str, Any], size: int, rng: np.random.Generator) -> np.ndarray:
    """Draw ``size`` floats from a distribution spec (``dist`` plus its parameters,
    optional ``min``/``max`` clipping)."""
    kind = spec["dist"]
    if kind == "const":
        out = np.full(size, float(spec["value"]))
    elif kind == "uniform":
        out = rng.uniform(spec["low"], spec["high"], size)
    elif kind == "lognormal":
        out = spec["median"] * np.exp(spec["sigma"] * rng.standard_normal(size))
    elif kind == "pareto":  # classic Pareto: xm * (1 + Lomax(alpha)), support [xm, inf)
        out = spec["xm"] * (1.0 + rng.pareto(spec["alpha"], size))
    elif kind == "choice":
        out = rng.choice(np.asarray(spec["values"], dtype=np.float64), size, p=spec.get("weights"))
    else:
        raise ValueError(f"unknown distribution {kind!r} in {dict(spec)}")
    return np.clip(out, spec.get("min", -np.inf), spec.get("max", np.inf))


def vision_tokens(height: np.ndarray, width: np.ndarray, min_pixels: int, max_pixels: int) -> np.ndarray:
    """Tokens of images after Qwen2-VL's resize: sides rounded to multiples of 28, then
    scaled down (or up) as a whole to fit ``[min_pixels, max_pixels]``."""
    h = np.maximum(FACTOR, np.round(height / FACTOR) * FACTOR)
    w = np.maximum(FACTOR, np.round(width / FACTOR) * FACTOR)
    area = height * width
    over = h * w > max_pixels
    beta = np.sqrt(area / max_pixels)
    h = np.where(over, np.maximum(FACTOR, np.floor(height / beta / FACTOR) * FACTOR), h)
    w = np.where(over, np.maximum(FACTOR, np.floor(width / beta / FACTOR) * FACTOR), w)
    under = h * w < min_pixels
    beta = np.sqrt(min_pixels / area)
    h = np.where(under, np.ceil(height * beta / FACTOR) * FACTOR, h)
    w = np.where(under, np.ceil(width * beta / FACTOR) * FACTOR, w)
    return (h // FACTOR * (w // FACTOR)).astype(np.int64)


def _visual(spec: Mapping[str, Any], count: int, rng: np.random.Generator) -> np.ndarray:
    """Tokens of ``count`` images (or single video frames) drawn from a resolution spec."""
    width = sample(spec["width"], count, rng)
    height = width * sample(spec["aspect"], count, rng)
    return vision_tokens(height, width, spec.get("min_pixels", DEFAULT_MIN_PIXELS), spec["max_pixels"])


def generate(spec: Mapping[str, Any], n: int, seed: int = 0) -> Workload:
    """``n`` samples of the workload ``spec``; the same seed gives the same samples."""
    rng = np.random.default_rng(seed)
    components = spec["components"]
    weights = np.array([c["weight"] for c in components], dtype=np.float64)
    which = rng.choice(len(components), n, p=weights / weights.sum())
    lengths = np.zeros(n, dtype=np.int64)
    images_per_sample = np.zeros(n, dtype=np.int64)
    all_owners: list[np.ndarray] = []
    all_tokens: list[np.ndarray] = []
    for k, comp in enumerate(components):
        rows = np.flatnonzero(which == k)
        text = np.round(sample(comp["text_tokens"], len(rows), rng)).astype(np.int64)
        lengths[rows] = text + comp.get("template_tokens", 0)
        tokens = np.zeros(0, dtype=np.int64)
        owners = np.zeros(0, dtype=np.int64)
        if "images" in comp:
            count = np.round(sample(comp["images"]["count"], len(rows), rng)).astype(np.int64)
            owners = np.repeat(rows, count)
            tokens = _visual(comp["images"], len(owners), rng)
        elif "video" in comp:
            frames = 2 * np.round(sample(comp["video"]["frames"], len(rows), rng) / 2).astype(np.int64)
            owners = rows
            tokens = _visual(comp["video"], len(rows), rng) * np.maximum(frames // 2, 1)
        np.add.at(lengths, owners, tokens)
        np.add.at(images_per_sample, owners, 1)
        all_owners.append(owners)
        all_tokens.append(tokens)
    # Lay the per-image patch counts out in sample order.
    owners, tokens = np.concatenate(all_owners), np.concatenate(all_tokens)
    by_sample = np.argsort(owners, kind="stable")
    offsets = np.concatenate(([0], np.cumsum(images_per_sample)))
    return Workload(spec["name"], lengths, tokens[by_sample] * PATCHES_PER_TOKEN, offsets)
