"""M-RoPE position ids per sample against MindSpeed-MM's real ``qwen2_5_vl_get_rope_index``.

Upstream's function runs in a child process on the pinned sources (unpacked by
``unpack.sh``, see ``pinned_upstream``): MindSpeed-MM's root with Megatron's ``megatron/``
on ``sys.path``, the real ``megatron.training.global_vars.set_args`` holding the few model
arguments the function reads, and ``vlm_attentionmask_for_llm.py`` loaded from its file
(importing the ``mindspeed_mm`` package would run its LoRA patches and need transformers);
the only stand-in is the name of the NPU device (PrivateUse1 renamed ``npu``).  Each sample
is given to upstream alone as a ``[1, T]`` batch, which is what a packed sample must match.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from mindspeed_flow.data.mrope import (
    IMAGE_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_START_TOKEN_ID,
    mrope_position_ids,
    packed_position_ids,
)
from pinned_upstream import upstream_sources
from subprocess_utils import last_json, run_python

VISION_END = 151653

UPSTREAM_ROPE = """
import importlib.util, json, sys
from types import SimpleNamespace
import torch
root, cases = sys.argv[1], json.load(open(sys.argv[2]))
sys.path.insert(0, root)
# The NPU cannot exist here: upstream evaluates torch.device("npu") at import (a default
# argument), which is valid once the PrivateUse1 backend carries that name.
torch.utils.rename_privateuse1_backend("npu")
from megatron.training import global_vars
encoder = SimpleNamespace(spatial_merge_size=2, tokens_per_second=2)
global_vars.set_args(SimpleNamespace(mm=SimpleNamespace(model=SimpleNamespace(
    vision_start_token_id=151652, image_encoder=SimpleNamespace(vision_encoder=encoder)))))
path = root + "/mindspeed_mm/models/vision/vlm_attentionmask_for_llm.py"
spec = importlib.util.spec_from_file_location("upstream_vlm_attentionmask_for_llm", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
assert module.get_args is global_vars.get_args
out = []
for case in cases:
    grid = lambda key: None if case[key] is None else torch.tensor(case[key], dtype=torch.long)
    seconds = None if case["seconds"] is None else torch.tensor(case["seconds"])
    ids, _ = module.qwen2_5_vl_get_rope_index(None, torch.tensor([case["ids"]]), grid("image"), grid("video"),
                                             seconds, None)
    out.append(ids[:, 0, :].tolist())
print(json.dumps(out))
"""


def vision_block(rng: np.random.Generator, grid: tuple[int, int, int], pad: int) -> list[int]:
    t, h, w = grid
    return [VISION_START_TOKEN_ID] + [pad] * (t * h * w // 4) + [VISION_END]


def sample(rng: np.random.Generator, grids: list[tuple[int, int, int]], pad: int = IMAGE_TOKEN_ID,
           leading_text: bool = True) -> list[int]:
    """Text, then for each grid a vision block followed by some text (random lengths)."""
    text = lambda n: rng.integers(0, 151000, n).tolist()
    ids = text(int(rng.integers(1, 20))) if leading_text else []
    for grid in grids:
        ids += vision_block(rng, grid, pad) + text(int(rng.integers(0, 15)))
    return ids


def case(ids, image=None, video=None, seconds=None) -> dict:
    return {"ids": ids, "image": image, "video": video, "seconds": seconds}


def image_cases() -> list[dict]:
    """Text-only, single-image, image-first, multi-image and back-to-back image samples."""
    rng = np.random.default_rng(0)
    image_grids = [(1, 2, 2), (1, 4, 6), (1, 8, 4), (1, 6, 10), (1, 16, 2), (1, 14, 14)]
    cases = [
        case(sample(rng, [])),  # text only, no grid at all (upstream's plain-text branch)
        case(sample(rng, []), image=[]),  # text only inside a batch that has images elsewhere
        case(sample(rng, [(1, 4, 6)]), image=[[1, 4, 6]]),
        case(sample(rng, [(1, 14, 14)], leading_text=False), image=[[1, 14, 14]]),  # image first
    ]
    for count in (2, 3, 5):  # several images of different grids in one sample
        grids = [image_grids[i] for i in rng.choice(len(image_grids), count, replace=False)]
        cases.append(case(sample(rng, grids), image=[list(g) for g in grids]))
    # Two images back to back with no text between, the last token a vision block's end.
    ids = [1, 2] + vision_block(rng, (1, 2, 4), IMAGE_TOKEN_ID) + vision_block(rng, (1, 6, 2), IMAGE_TOKEN_ID)
    cases.append(case(ids, image=[[1, 2, 4], [1, 6, 2]]))
    return cases


def video_cases() -> list[dict]:
    """One two-video sample, with and without seconds per grid.  Upstream (57069cd) reads a
    video's grid from ``image_grid_thw[video_index]``: the video grids go there too."""
    rng = np.random.default_rng(1)
    ids = sample(rng, [(3, 4, 4), (4, 2, 6)], pad=VIDEO_TOKEN_ID)
    video = [[3, 4, 4], [4, 2, 6]]
    return [case(ids, image=video, video=video, seconds=[0.5, 1.75]), case(ids, image=video, video=video)]


@pytest.fixture(scope="module")
def upstream_ids(tmp_path_factory) -> dict[str, list[torch.Tensor]]:
    """Upstream's ``[3, T]`` ids of every case, from one child process."""
    cases = {"image": image_cases(), "video": video_cases()}
    path = tmp_path_factory.mktemp("cases") / "cases.json"
    path.write_text(json.dumps(cases["image"] + cases["video"]))
    ids = last_json(run_python(UPSTREAM_ROPE, [str(upstream_sources().mindspeed_mm), str(path)]))
    ids = [torch.tensor(i) for i in ids]
    return {"image": ids[: len(cases["image"])], "video": ids[len(cases["image"]) :]}


def test_images_and_text_match_upstream_sample_by_sample(upstream_ids):
    expected = upstream_ids["image"]
    for i, (c, want) in enumerate(zip(image_cases(), expected, strict=True)):
        got = mrope_position_ids(torch.tensor(c["ids"]), c["image"])
        assert got.dtype == torch.long and got.shape == (3, len(c["ids"])), i
        assert torch.equal(got, want), f"case {i}: first difference at token {(got != want).any(0).nonzero()[0]}"
    # The comparison has teeth: a multi-image sample really has 3-D (non-diagonal) positions.
    assert not torch.equal(expected[4][0], expected[4][1])


def test_video_matches_upstream_given_its_grid_in_image_grid_thw(upstream_ids):
    """Given the video grids in ``image_grid_thw`` (see :func:`video_cases`), upstream computes
    the video path we implement with ``video_grid_thw`` (temporal ids scaled by seconds per
    grid x tokens per second)."""
    with_seconds, default = video_cases()
    want_seconds, want_default = upstream_ids["video"]
    assert torch.equal(mrope_position_ids(with_seconds["ids"], None, with_seconds["video"], [0.5, 1.75]),
                       want_seconds)
    # 1 s per grid when none is given
    assert torch.equal(mrope_position_ids(default["ids"], None, default["video"]), want_default)
    assert not torch.equal(want_seconds, want_default)


def test_packed_ids_restart_at_every_sample():
    rng = np.random.default_rng(2)
    first = sample(rng, [(1, 4, 4)])
    second = sample(rng, [])
    third = sample(rng, [(1, 2, 6), (1, 4, 2)])
    per_sample = [mrope_position_ids(first, [[1, 4, 4]]), mrope_position_ids(second),
                  mrope_position_ids(third, [[1, 2, 6], [1, 4, 2]])]
    packed = packed_position_ids(per_sample)
    total = len(first) + len(second) + len(third)
    assert packed.shape == (3, 1, total)
    starts = [0, len(first), len(first) + len(second)]
    assert all(packed[:, 0, s].tolist() == [0, 0, 0] for s in starts)
    assert torch.equal(packed[:, 0, starts[1] : starts[2]], torch.arange(len(second)).expand(3, -1))
    assert torch.equal(packed[:, 0, starts[2] :], per_sample[2])


def test_mismatched_tokens_and_grids_are_refused_by_name():
    ids = [5, VISION_START_TOKEN_ID] + [IMAGE_TOKEN_ID] * 6 + [VISION_END, 7]
    with pytest.raises(ValueError, match=r"1 image block\(s\).*but 2 image grid"):
        mrope_position_ids(ids, [[1, 4, 6], [1, 2, 2]])
    with pytest.raises(ValueError, match="vision block at token 2 has 6 pad tokens, its grid \\(1, 4, 4\\)"):
        mrope_position_ids(ids, [[1, 4, 4]])
    with pytest.raises(ValueError, match="multiples of the merge size 2"):
        mrope_position_ids(ids, [[1, 3, 8]])
    with pytest.raises(ValueError, match="one sample"):
        mrope_position_ids(torch.tensor([ids]), [[1, 4, 6]])
    with pytest.raises(ValueError, match="second_per_grid_ts has 2 entries for 0 video"):
        mrope_position_ids(ids, [[1, 4, 6]], None, [1.0, 2.0])
    with pytest.raises(ValueError, match=r"sample 1 of the pack.*\[3, T\]"):
        packed_position_ids([torch.zeros(3, 4, dtype=torch.long), torch.zeros(4, dtype=torch.long)])
