"""The loader with Hugging Face objects: images against ``Qwen2VLImageProcessor``, text through
a real ``Qwen2TokenizerFast`` (built from the demo tokenizer's file) and a processor.

``transformers`` is not a dependency of the main environment (MindSpeed-MM pins 4.57.0), so
this runs in a child process of an interpreter that can import what it needs (transformers 5
wants torchvision for the image processor): this one if it can, else the
upstream environment of ``scripts/setup_upstream_env.sh`` (``MINDSPEED_FLOW_UPSTREAM_VENV``,
default ``.venv-upstream``).  Without either the test skips, saying so; with
``MINDSPEED_FLOW_UPSTREAM_REQUIRED=1`` it fails instead.
The processor is the Hugging Face tokenizer and image processor carried as
``.tokenizer`` / ``.image_processor`` (what the loader reads of a processor): a real
``Qwen2VLProcessor`` also wants a video processor, which needs torchvision.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from data_corpus import demo_corpus
from subprocess_utils import last_json

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import json, sys
from types import SimpleNamespace
import numpy as np, torch
from PIL import Image
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen2TokenizerFast
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.images import load_image, normalize
from mindspeed_flow.data.tokenizer import load_tokenizer

corpus, images = sys.argv[1], sys.argv[2:]
image_processor = Qwen2VLImageProcessor(min_pixels=3136, max_pixels=50176)
diffs, grids = [], []
for path in images:
    hf = image_processor(images=[Image.open(path).convert("RGB")], return_tensors="np")
    rows, grid = load_image(path, 3136, 50176)
    grids.append([hf["image_grid_thw"].tolist()[0], list(grid)])
    diffs.append(float(np.abs(normalize(torch.from_numpy(rows)).numpy() - hf["pixel_values"]).max()))
tokenizer = Qwen2TokenizerFast(tokenizer_file=f"{corpus}/flow_demo_tokenizer.json")
processor = SimpleNamespace(tokenizer=tokenizer, image_processor=image_processor)

def epoch(tok, **pixels):
    loader = FlowDataLoader(corpus, tok, capacity=1024, num_workers=0, window=4, **pixels)
    return [(b["sample_ids"], b["input_ids"].tolist(), b["labels"].tolist(), b["pixel_values"].shape[0]) for b in loader]

small = {"min_pixels": 3136, "max_pixels": 50176}
demo = epoch(None, **small)
try:
    load_tokenizer(PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE())), corpus)
    refused = None
except ValueError as e:
    refused = str(e)
print(json.dumps({"diffs": diffs, "grids": grids, "packs": len(demo), "refused": refused,
                  "processor": epoch(processor) == demo, "tokenizer": epoch(tokenizer, **small) == demo}))
"""


PROBE = ("from transformers import Qwen2TokenizerFast; "
         "from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor; "
         "import torchdata, mindspeed_flow")


def _python_with_transformers() -> str | None:
    """This interpreter or the upstream environment's, whichever imports what the child needs."""
    venv = Path(os.environ.get("MINDSPEED_FLOW_UPSTREAM_VENV", REPO / ".venv-upstream"))
    for python in (sys.executable, str(venv / "bin" / "python")):
        if Path(python).is_file() and subprocess.run([python, "-c", PROBE], capture_output=True,
                                                     timeout=120).returncode == 0:
            return python
    return None


def python_with_transformers() -> str:
    """:func:`_python_with_transformers`, or skip (fail where the upstream set requires it)."""
    python = _python_with_transformers()
    if python is None:
        message = "no interpreter with transformers (run scripts/setup_upstream_env.sh)"
        if os.environ.get("MINDSPEED_FLOW_UPSTREAM_REQUIRED") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python


def test_images_and_tokenizers_match_hugging_face(tmp_path_factory, tmp_path):
    python = python_with_transformers()
    rng = np.random.default_rng(0)
    images = []
    for i, (w, h) in enumerate([(40, 448), (448, 40), (30, 30), (1000, 700), (224, 224), (57, 113)]):
        images.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(images[-1])
    corpus = demo_corpus(tmp_path_factory, samples=20)
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    proc = subprocess.run([python, str(child), str(corpus), *images], capture_output=True, text=True, timeout=300,
                          cwd=REPO)
    out = last_json(proc)
    assert all(hf == mine for hf, mine in out["grids"])  # same dynamic resolution
    assert max(out["diffs"]) < 1e-5  # same pixels, float rounding apart
    assert out["packs"] > 1 and out["tokenizer"] and out["processor"]  # same packs as the demo tokenizer
    assert "no id for the special token(s)" in out["refused"] and "<|image_pad|>" in out["refused"]
