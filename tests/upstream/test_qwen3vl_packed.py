"""A pack from the plugin's loader equals its samples one by one on MindSpeed-MM's real Qwen3-VL
(``pretrain_transformers.py``'s model, issue 25), DeepStack included, on the varlen path.

The samples: five conversations written here, three of them with images of different sizes (one
with two images) and two text-only, decoded by the plugin's ``FlowDataLoader`` with the tiny
Qwen3-VL's own processor (16-pixel patches, its mean/std) into one pack, which the plugin's batch
adapter turns into the batch this model reads (``seqlens`` / ``indices`` as upstream's
``DynamicBatchingDataLoader.collect_fn`` makes them, ``pixel_values``, ``image_grid_thw``; the
model builds the per-sample M-RoPE ids itself through ``get_rope_index`` and injects DeepStack
features in the pack's image order).  The reference: each sample alone in the unpacked batch
upstream's collator gives the model (``input_ids`` / ``attention_mask`` / ``labels`` ``[1, L]``,
its pixels and grid, no ``seqlens``), through the model's own unpacked path.

``qwen3vl_packed_driver.py`` runs the model in a subprocess, fp32: the entry script's YAML reader,
MindSpeed's adaptor, Megatron initialised as ``pretrain`` does, the script's ``model_provider``
and ``forward_step`` (the HF weights written by ``realjob_qwen3vl_assets``: 2 ViT blocks with a
DeepStack merger after block 0, 2 LLM layers).  The recipe's YAML with the ViT and projector
trainable, so every parameter has a gradient.

Asserted: the summed per-token loss (``loss * loss tokens``) and every parameter's gradient of the
pack equal the sums over the samples one by one, within the fp32 bounds of the Qwen2.5-VL
equality tests (``test_vlm_equivalence``); DeepStack is on (its merger trained, its features
injected into the pack's image positions); every attention call of the pack, ViT and LLM, is the
TND kernel with the pack's segment ends, and no op builds a ``[.., S, S]`` tensor over the pack's
tokens or the ViT's patches (no dense mask).  A pack of the text-only samples gets the fake image
(its own trailing segment, labels -100): the ViT runs on it, its gradients are zero, and the
summed loss and every gradient equal the text-only samples one by one (no ViT there) within the
same bounds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import MODEL_DEPENDENCIES, REAL_JOB_DEPENDENCIES, require
from pinned_upstream import upstream_sources
from realjob import run_env
from realjob_assets import IMAGE_PAD_ID, tag
from realjob_transformers import TransformersJob
from test_vlm_equivalence import FP32_GRAD_RTOL, FP32_LOSS_RTOL, gradient_errors

DRIVER = Path(__file__).resolve().parent / "qwen3vl_packed_driver.py"
TRAINABLE = (("model.image_encoder.vision_encoder.freeze", False),
             ("model.image_encoder.vision_projector.freeze", False))
# (image sizes (width, height), words): multiples of 32 pixels (patch 16 x merge 2) within the
# processor's bounds, so each image keeps its size: 4, 12 + 8 and 6 LLM tokens.
SAMPLES = (
    ([(64, 64)], "what colour is the small square in the corner"),
    ([], "one two three is a text only question with no picture"),
    ([(128, 96), (64, 128)], "where is the bright shape in the two pictures"),
    ([(96, 64)], "the dark circle is near the left of the image"),
    ([], "four five six is another question without any image"),
)
TEXT_ONLY = [index for index, (sizes, _) in enumerate(SAMPLES) if not sizes]


def write_corpus(root: Path) -> Path:
    """The four conversations as a MindSpeed-MM ``mllm_format`` JSON file with their PNGs."""
    from PIL import Image

    (root / "images").mkdir(parents=True, exist_ok=True)
    records = []
    for index, (sizes, words) in enumerate(SAMPLES):
        images = []
        for k, (width, height) in enumerate(sizes):
            name = f"images/{index}_{k}.png"
            Image.new("RGB", (width, height), (40 * index + 30, 90 + 50 * k, 200 - 30 * index)).save(root / name)
            images.append(name)
        records.append({"messages": [{"role": "user", "content": "<image>" * len(sizes) + f"{tag(index)} {words}?"},
                                     {"role": "assistant", "content": f"{words} and {tag(index)}."}],
                        "images": images})
    (root / "data.json").write_text(json.dumps(records, indent=1))
    return root / "data.json"


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    require(MODEL_DEPENDENCIES + REAL_JOB_DEPENDENCIES, "the Qwen3-VL packed-equality test")
    root = tmp_path_factory.mktemp("qwen3vl_packed")
    job = TransformersJob(yaml_patch=TRAINABLE)
    assets = job.make_assets(root / "assets")
    corpus = write_corpus(root / "corpus")
    workdir = root / "run"
    workdir.mkdir()
    sources = upstream_sources()
    _, args = job.script_and_args(sources, workdir, assets)  # the YAML and the reader's folder
    env = run_env(sources, workdir, assets, job)
    env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_free_port()), "QWEN3VL_PACKED_CORPUS": str(corpus),
                "QWEN3VL_PACKED_PROCESSOR": str(assets.processor),
                "QWEN3VL_PACKED_OUT": str(workdir / "out.pt"),
                "QWEN3VL_PACKED_TEXT_ONLY": ",".join(map(str, TEXT_ONLY))})
    proc = subprocess.run([sys.executable, str(DRIVER), *args], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"driver failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return torch.load(workdir / "out.pt", weights_only=False)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_pack_holds_every_sample_with_images_of_different_sizes(result):
    assert sorted(result["order"]) == list(range(len(SAMPLES)))
    assert len(result["batch"]["seqlens"]) == len(SAMPLES)
    grids = {tuple(g) for g in result["batch"]["image_grid_thw"].tolist()}
    assert len(grids) == sum(len(sizes) for sizes, _ in SAMPLES) == 4  # four images, four sizes
    assert result["model_class"].startswith("mindspeed_mm.models.transformers.qwen3vl.")


def test_packed_loss_and_gradients_equal_the_samples_one_by_one(result):
    packed, one_by_one = result["packed"], result["one_by_one"]
    assert packed["loss_tokens"] == one_by_one["loss_tokens"] > 0
    assert packed["loss_sum"] == pytest.approx(one_by_one["loss_sum"], rel=FP32_LOSS_RTOL)
    reference = one_by_one["grads"]
    assert len(reference) > 20 and all(g.norm() > 0 for g in reference.values()), "a parameter got no gradient"
    errors = gradient_errors(reference, packed["grads"])
    worst = max(errors, key=errors.get)
    print(f"Qwen3-VL pack of {len(SAMPLES)} vs one by one: loss sum {packed['loss_sum']:.6f} vs "
          f"{one_by_one['loss_sum']:.6f} (relative {abs(packed['loss_sum'] / one_by_one['loss_sum'] - 1):.1e}); "
          f"worst gradient error {errors[worst]:.1e} ({worst}) over {len(errors)} parameters")
    assert errors[worst] <= FP32_GRAD_RTOL, f"{worst}: relative gradient error {errors[worst]:.2e}"


def test_the_pack_read_as_one_sequence_is_far_off(result):
    """The control that gives the bounds their meaning: the same tokens without ``seqlens`` /
    ``indices`` (the samples attend to each other, positions run on over the pack)."""
    errors = gradient_errors(result["one_by_one"]["grads"], result["packed_as_one"]["grads"])
    assert max(errors.values()) > 500 * FP32_GRAD_RTOL


def test_deepstack_is_on_and_fed_the_packs_images(result):
    assert result["deepstack_visual_indexes"] == [0]
    image_tokens = int((result["batch"]["input_ids"] == IMAGE_PAD_ID).sum())
    # one injection per DeepStack layer, at every image position of the pack
    assert result["packed"]["deepstack"] == [{"positions": image_tokens, "rows": image_tokens}]
    merger = [name for name in result["packed"]["grads"] if "deepstack_merger_list" in name]
    assert merger and all(result["packed"]["grads"][name].norm() > 0 for name in merger)


def test_the_pack_runs_on_the_varlen_kernel_without_a_dense_mask(result):
    packed = result["packed"]
    assert result["attn"] == {"vision": "flash_attention_2", "text": "flash_attention_2", "text_layout": "TND"}
    assert packed["square"] == []  # no [.., S, S] tensor over the pack's tokens or the ViT's patches
    calls = packed["kernel"]
    assert calls and all(c["layout"] == "TND" for c in calls)
    ends = result["batch"]["seqlens"].cumsum(0).tolist()
    grid = result["batch"]["image_grid_thw"]
    vit_ends = (grid[:, 1] * grid[:, 2]).cumsum(0).tolist()
    text_calls = [c for c in calls if c["actual_seq_qlen"] == ends]
    vit_calls = [c for c in calls if c["actual_seq_qlen"] == vit_ends]
    assert len(text_calls) == 2 and len(vit_calls) == 2 and len(calls) == 4  # 2 LLM layers, 2 ViT blocks


def test_a_text_only_pack_runs_the_vit_on_its_fake_image_and_equals_its_samples_one_by_one(result):
    batch, packed, one_by_one = result["text_only_batch"], result["text_only_packed"], result["text_only_one_by_one"]
    assert len(TEXT_ONLY) == 2 and len(batch["seqlens"]) == len(TEXT_ONLY) + 1  # the samples, then the fake image
    fake_tokens = int(batch["seqlens"][-1])
    assert (batch["labels"][0, -fake_tokens:] == -100).all() and (batch["attention_mask"][0, -fake_tokens:] == 0).all()
    grid = batch["image_grid_thw"]
    assert grid.shape == (1, 3) and int((batch["input_ids"] == IMAGE_PAD_ID).sum()) == fake_tokens - 2
    vit_ends = (grid[:, 1] * grid[:, 2]).cumsum(0).tolist()
    assert len([c for c in packed["kernel"] if c["actual_seq_qlen"] == vit_ends]) == 2  # the ViT ran: 2 blocks
    assert not any(c["actual_seq_qlen"] == vit_ends for c in one_by_one["kernel"])  # alone, the samples skip it
    assert packed["loss_tokens"] == one_by_one["loss_tokens"] > 0
    assert packed["loss_sum"] == pytest.approx(one_by_one["loss_sum"], rel=FP32_LOSS_RTOL)
    vit = [name for name in packed["grads"] if ".visual." in name]
    assert vit and all(float(packed["grads"][name].abs().max()) == 0.0 for name in vit)
    errors = gradient_errors(one_by_one["grads"], packed["grads"])
    worst = max(errors, key=errors.get)
    print(f"Qwen3-VL text-only pack of {len(TEXT_ONLY)} with a fake image of {fake_tokens - 2} tokens vs one by one: "
          f"loss sum relative {abs(packed['loss_sum'] / one_by_one['loss_sum'] - 1):.1e}; worst gradient error "
          f"{errors[worst]:.1e} ({worst}) over {len(errors)} parameters")
    assert errors[worst] <= FP32_GRAD_RTOL, f"{worst}: relative gradient error {errors[worst]:.2e}"
