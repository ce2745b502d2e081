"""Qwen2.5-VL M-RoPE position ids, computed per sample so that packs can be built from them.

MindSpeed-MM computes the three-axis (temporal, height, width) rotary positions inside the
model (``qwen2_5_vl_get_rope_index``) over a padded ``[B, S]`` batch.  A packed microbatch
holds several samples in one row, and every sample must see the positions it would have
had alone: positions restart at 0 at each sample boundary.  So the loader computes the
ids of each sample with :func:`mrope_position_ids` and joins them with
:func:`packed_position_ids` into the ``[3, 1, T]`` tensor the packed forward reads.

The rule, for one sample: text tokens count up by one on all three axes.  A vision block
(the image/video pad tokens of one image or video, ``t * (h/m) * (w/m)`` tokens for a grid
``(t, h, w)`` and merge size ``m``) starts at ``s``, the position the next text token would
have had, and gives its token at grid cell ``(i, j, k)`` the ids
``(s + floor(i * seconds_per_grid * tokens_per_second), s + j, s + k)``; images use
``seconds_per_grid = 0``, videos their ``second_per_grid_ts`` entry (1.0 when none is
given).  Text after a block continues at ``1 + max`` of the block's ids.

One deliberate difference from upstream (57069cd): upstream reads a video's grid from
``image_grid_thw[video_index]``; this module reads ``video_grid_thw``, which is what
Hugging Face's Qwen2.5-VL does and what the grid means.  For samples with images only
and for text-only samples the two agree exactly (tested against upstream's function).
"""

from __future__ import annotations

from typing import Sequence

import torch

IMAGE_TOKEN_ID = 151655  # <|image_pad|>
VIDEO_TOKEN_ID = 151656  # <|video_pad|>
VISION_START_TOKEN_ID = 151652  # <|vision_start|>


def mrope_position_ids(
    input_ids: torch.Tensor | Sequence[int],
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
    video_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
    second_per_grid_ts: torch.Tensor | Sequence[float] | None = None,
    *,
    image_token_id: int = IMAGE_TOKEN_ID,
    video_token_id: int = VIDEO_TOKEN_ID,
    vision_start_token_id: int = VISION_START_TOKEN_ID,
    spatial_merge_size: int = 2,
    tokens_per_second: float = 2,
) -> torch.Tensor:
    """``LongTensor [3, T]``: M-RoPE ids (temporal, height, width) of one sample of ``T`` tokens.

    ``image_grid_thw`` / ``video_grid_thw`` hold the ``(t, h, w)`` patch grid (before the
    spatial merge) of this sample's images / videos in the order they appear.  A vision
    block is a ``<|vision_start|>`` token followed by a run of image (video) pad tokens.

    Raises ``ValueError`` naming the problem when the tokens and the grids disagree (block
    count, a block's token count, a grid not divisible by the merge size), since wrong
    positions would train silently.
    """
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 1:
        raise ValueError(f"input_ids must be one sample (1-D), got shape {tuple(ids.shape)}")
    grids = {
        image_token_id: _grids(image_grid_thw, "image_grid_thw"),
        video_token_id: _grids(video_grid_thw, "video_grid_thw"),
    }
    video_seconds = _video_seconds(second_per_grid_ts, len(grids[video_token_id]))
    blocks = _vision_blocks(ids, image_token_id, video_token_id, vision_start_token_id)
    for token, name in ((image_token_id, "image"), (video_token_id, "video")):
        found = sum(1 for _, kind in blocks if kind == token)
        if found != len(grids[token]):
            raise ValueError(f"sample has {found} {name} block(s) (<|vision_start|> + {name} pad) "
                             f"but {len(grids[token])} {name} grid(s)")

    length = ids.numel()
    out = torch.empty(3, length, dtype=torch.long)
    used = {image_token_id: 0, video_token_id: 0}
    cursor = 0  # next token to place
    next_position = 0  # position of the next text token
    for start, kind in blocks:
        index = used[kind]
        used[kind] += 1
        grid = grids[kind][index]
        per_grid = 0 if kind == image_token_id else video_seconds[index]  # an image has one time step
        out[:, cursor:start] = torch.arange(next_position, next_position + start - cursor)
        next_position += start - cursor
        size = _fill_block(out, ids, start, grid, per_grid, kind, spatial_merge_size, tokens_per_second,
                           next_position)
        next_position = int(out[:, start : start + size].max()) + 1
        cursor = start + size
    out[:, cursor:] = torch.arange(next_position, next_position + length - cursor)
    return out


def packed_position_ids(per_sample: Sequence[torch.Tensor]) -> torch.Tensor:
    """Join per-sample ``[3, T_i]`` ids (from :func:`mrope_position_ids`) into the packed
    ``[3, 1, sum T_i]`` tensor, samples in pack order (each still starts from its own 0)."""
    if not per_sample:
        raise ValueError("a pack needs at least one sample")
    for i, ids in enumerate(per_sample):
        if ids.dim() != 2 or ids.shape[0] != 3:
            raise ValueError(f"sample {i} of the pack: position ids must be [3, T], got {tuple(ids.shape)}")
    return torch.cat(list(per_sample), dim=1).unsqueeze(1)


def _grids(grid_thw, name: str) -> list[tuple[int, int, int]]:
    """Grid rows as int triples; ``None`` is no grid."""
    if grid_thw is None:
        return []
    grid = torch.as_tensor(grid_thw, dtype=torch.long)
    if grid.numel() and (grid.dim() != 2 or grid.shape[1] != 3):
        raise ValueError(f"{name} must be [N, 3] (t, h, w per row), got shape {tuple(grid.shape)}")
    if bool((grid < 1).any()):
        raise ValueError(f"{name} has a non-positive entry: {grid.tolist()}")
    return [tuple(row) for row in grid.reshape(-1, 3).tolist()]


def _video_seconds(second_per_grid_ts, videos: int) -> list:
    """One temporal spacing per video: the given entry (kept as given, so the arithmetic
    below promotes types the way upstream's does), or 1.0 second when none is given."""
    if second_per_grid_ts is None:
        return [1.0] * videos
    if len(second_per_grid_ts) != videos:
        raise ValueError(f"second_per_grid_ts has {len(second_per_grid_ts)} entries for {videos} video(s)")
    return [second_per_grid_ts[i] for i in range(videos)]


def _vision_blocks(ids: torch.Tensor, image: int, video: int, vision_start: int) -> list[tuple[int, int]]:
    """``(first pad token, pad token id)`` of every vision block, in token order."""
    starts = torch.nonzero(ids[:-1] == vision_start).flatten() + 1
    kinds = ids[starts]
    keep = (kinds == image) | (kinds == video)
    return list(zip(starts[keep].tolist(), kinds[keep].tolist()))


def _fill_block(out: torch.Tensor, ids: torch.Tensor, start: int, grid: tuple[int, int, int], per_grid,
                kind: int, merge: int, tokens_per_second: float, base: int) -> int:
    """Write the ids of one vision block starting at token ``start``; return its token count."""
    t, h, w = grid
    if h % merge or w % merge:
        raise ValueError(f"grid {grid} at token {start}: h and w must be multiples of the merge size {merge}")
    gh, gw = h // merge, w // merge
    size = t * gh * gw
    others = torch.nonzero(ids[start:] != kind)
    run = int(others[0]) if len(others) else ids.numel() - start  # pad tokens in a row
    if run != size:
        raise ValueError(f"vision block at token {start} has {run} pad tokens, its grid {grid} "
                         f"(merge {merge}) needs {size}")
    temporal = (torch.arange(t) * per_grid * tokens_per_second).long()
    out[0, start : start + size] = base + temporal.repeat_interleave(gh * gw)
    out[1, start : start + size] = base + torch.arange(gh).repeat_interleave(gw).repeat(t)
    out[2, start : start + size] = base + torch.arange(gw).repeat(t * gh)
    return size
