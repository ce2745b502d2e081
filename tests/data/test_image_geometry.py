"""Images cut in the job's processor geometry (:class:`ImageGeometry`): Qwen3-VL's 16-pixel
patches with mean/std 0.5 as its ``preprocessor_config.json`` says, Qwen2-VL's 14-pixel CLIP
layout when there is no image processor; a processor without a needed value is refused by
name.  The images are compared with transformers' own ``Qwen2VLImageProcessor`` configured
as Qwen3-VL's (in a child interpreter that has transformers, as ``test_hf.py`` does)."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.errors import ProcessorConfigError
from mindspeed_flow.data.images import QWEN2_VL, ImageGeometry, load_image, normalize, patchify
from mindspeed_flow.data.tokenizer import load_tokenizer

from data_corpus import demo_corpus
from subprocess_utils import last_json
from tests.data.test_hf import REPO, python_with_transformers

QWEN3_VL_PREPROCESSOR = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3,
                         "image_std": [0.5] * 3, "min_pixels": 64 * 64, "max_pixels": 128 * 128}
QWEN3_VL = ImageGeometry(16, 2, 2, (0.5,) * 3, (0.5,) * 3, 64 * 64, 128 * 128)


def test_geometry_is_read_from_the_processor():
    assert ImageGeometry.from_processor(SimpleNamespace(**QWEN3_VL_PREPROCESSOR)) == QWEN3_VL
    # newer processors keep the pixel bounds in size: {shortest_edge, longest_edge} only
    sized = {k: v for k, v in QWEN3_VL_PREPROCESSOR.items() if not k.endswith("_pixels")}
    sized["size"] = {"shortest_edge": 64 * 64, "longest_edge": 128 * 128}
    assert ImageGeometry.from_processor(SimpleNamespace(**sized)) == QWEN3_VL
    assert QWEN3_VL.row_size == 3 * 2 * 16 * 16 and QWEN3_VL.factor == 32 and QWEN2_VL.row_size == 1176


@pytest.mark.parametrize("missing", ["patch_size", "merge_size", "temporal_patch_size", "image_mean", "max_pixels"])
def test_a_processor_without_a_needed_value_is_refused_naming_file_and_key(missing):
    values = {k: v for k, v in QWEN3_VL_PREPROCESSOR.items() if k != missing}
    with pytest.raises(ProcessorConfigError) as e:
        ImageGeometry.from_processor(SimpleNamespace(**values), "/models/q3/preprocessor_config.json")
    assert "/models/q3/preprocessor_config.json" in str(e.value) and repr(missing) in str(e.value)


def test_patchify_in_16_pixel_patches_keeps_merge_groups_consecutive():
    image = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    rows, grid = patchify(image, QWEN3_VL)
    assert grid == (1, 4, 6) and rows.shape == (24, 1536)
    for r in range(24):
        block, inner = divmod(r, 4)
        bh, bw = divmod(block, 3)
        mh, mw = divmod(inner, 2)
        y, x = (2 * bh + mh) * 16, (2 * bw + mw) * 16
        patch = image[y:y + 16, x:x + 16].transpose(2, 0, 1)
        assert np.array_equal(rows[r], np.stack([patch, patch], axis=1).reshape(-1))
    assert torch.allclose(normalize(torch.from_numpy(rows[:1]), QWEN3_VL),
                          torch.from_numpy(rows[:1]).float() / 255 * 2 - 1, atol=1e-6)


def test_the_loader_cuts_images_as_its_processor_says(tmp_path_factory):
    corpus = demo_corpus(tmp_path_factory, samples=12)
    processor = SimpleNamespace(tokenizer=load_tokenizer(None, corpus).backend,
                                image_processor=SimpleNamespace(**QWEN3_VL_PREPROCESSOR))
    loader = FlowDataLoader(corpus, processor, capacity=1024, num_workers=0, window=4)
    assert loader.geometry == QWEN3_VL
    image_pad = load_tokenizer(None, corpus).special.image_pad
    batches = list(loader)
    grids = torch.cat([b["image_grid_thw"] for b in batches])
    assert len(grids) and all(b["pixel_values"].shape[1] == 1536 for b in batches)
    assert all(h * w * 256 * t <= 2 * 128 * 128 and h % 2 == 0 and w % 2 == 0 for t, h, w in grids.tolist())
    for b in batches:  # each image stands for t*h*w/4 tokens of the pack
        assert int((b["input_ids"] == image_pad).sum()) == int(b["image_grid_thw"].prod(dim=1).sum()) // 4
    state = loader.state_dict()
    assert state["image_geometry"] == (16, 2, 2, (0.5,) * 3, (0.5,) * 3)
    qwen2 = FlowDataLoader(corpus, None, capacity=1024, num_workers=0, window=4)
    with pytest.raises(ValueError, match="image_geometry"):
        qwen2.load_state_dict(state)  # another patch size changes every held sample


CHILD = """
import json, sys
import numpy as np, torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from mindspeed_flow.data.images import ImageGeometry, load_image, normalize

processor = Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                  image_std=[0.5] * 3, min_pixels=64 * 64, max_pixels=256 * 256)
geometry = ImageGeometry.from_processor(processor)
out = []
for path in sys.argv[1:]:
    hf = processor(images=[Image.open(path).convert("RGB")], return_tensors="np")
    rows, grid = load_image(path, geometry.min_pixels, geometry.max_pixels, geometry)
    out.append([hf["image_grid_thw"].tolist()[0], list(grid),
                float(np.abs(normalize(torch.from_numpy(rows), geometry).numpy() - hf["pixel_values"]).max())])
print(json.dumps(out))
"""


def test_qwen3_vl_images_match_hugging_face(tmp_path):
    python = python_with_transformers()
    rng = np.random.default_rng(1)
    images = []
    for i, (w, h) in enumerate([(40, 300), (300, 40), (30, 30), (500, 350), (57, 113)]):
        images.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(images[-1])
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    proc = subprocess.run([python, str(child), *images], capture_output=True, text=True, timeout=300, cwd=REPO)
    out = last_json(proc)
    assert all(hf == mine for hf, mine, _ in out)  # same dynamic resolution, 32-pixel multiples
    assert max(diff for _, _, diff in out) < 1e-5  # same pixels in 16-pixel patches, float rounding apart
    assert load_image(images[0], 64 * 64, 256 * 256, QWEN3_VL)[0].shape[1] == 1536
