"""What ``pretrain_transformers.py`` reads for the tiny Qwen3-VL job, made offline: one local
Hugging Face directory that is both the model (``config.json`` + random ``model.safetensors``)
and the processor (``Qwen3VLProcessor``: tokenizer, image and video processors with Qwen3-VL's
16-pixel patches), as the recipe's ``HF_MODEL_LOAD_PATH`` is.

The tokenizer and chat template are :mod:`realjob_assets`' (Qwen's special tokens at their real
ids, sample tags readable back from ``input_ids``); only the image side differs from the
Qwen2.5-VL job: ``patch_size`` 16 (Qwen2-VL's is 14), so a pack cut at 14 pixels cannot be
fed to this model.  The corpus is :func:`realjob_assets.make_corpus`'s.

The model is 2 vision blocks (one DeepStack merger, after block 0) and 2 LLM layers of width
64, written with transformers' own ``Qwen3VLForConditionalGeneration`` from a fixed seed.
Nothing is fetched; the same arguments give the same files.
"""

from __future__ import annotations

import json
from pathlib import Path

import realjob_assets

PATCH_SIZE = 16  # Qwen3-VL's (Qwen2-VL / Qwen2.5-VL: 14)
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
HIDDEN = 64
VOCAB = 151936
PROCESSOR_CLASS = "Qwen3VLProcessor"
# Pixel bounds of the processor (multiples of (16 x 2)^2): each image is 4-16 tokens after the merge.
MIN_PIXELS = 64 * 64
MAX_PIXELS = 128 * 128


def model_config() -> dict:
    """The tiny Qwen3-VL's ``config.json`` content (transformers 4.57's ``Qwen3VLConfig``)."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "image_token_id": realjob_assets.IMAGE_PAD_ID, "video_token_id": 151656,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653, "tie_word_embeddings": False,
        "vision_config": {
            "model_type": "qwen3_vl", "depth": 2, "hidden_size": HIDDEN, "intermediate_size": 128,
            "num_heads": 2, "in_channels": 3, "patch_size": PATCH_SIZE, "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE, "out_hidden_size": HIDDEN,
            "num_position_embeddings": 64, "deepstack_visual_indexes": [0], "hidden_act": "gelu_pytorch_tanh",
        },
        "text_config": {
            "model_type": "qwen3_vl_text", "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "max_position_embeddings": 4096, "rope_theta": 5000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        },
    }


def make_model(root: Path, seed: int = 0) -> Path:
    """Random weights of :func:`model_config` saved in HF format into ``root``."""
    import torch
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**model_config()))
    model.save_pretrained(root, safe_serialization=True)
    return root


def _image_processing(kind: str) -> dict:
    return {
        f"{kind}_processor_type": "Qwen2VLImageProcessor" if kind == "image" else "Qwen3VLVideoProcessor",
        "processor_class": PROCESSOR_CLASS, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "do_convert_rgb": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, "min_pixels": MIN_PIXELS,
        "max_pixels": MAX_PIXELS, "patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        "merge_size": MERGE_SIZE, "resample": 3,
    }


def make_processor(root: Path) -> Path:
    """:func:`realjob_assets.make_processor`'s tokenizer, made a ``Qwen3VLProcessor`` with
    16-pixel patches (its Qwen2.5-VL image files replaced)."""
    realjob_assets.make_processor(root)
    config = json.loads((root / "tokenizer_config.json").read_text())
    config["processor_class"] = PROCESSOR_CLASS
    (root / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (root / "preprocessor_config.json").write_text(json.dumps(_image_processing("image"), indent=1))
    (root / "video_preprocessor_config.json").write_text(json.dumps(_image_processing("video"), indent=1))
    return root


def make_hf_dir(root: Path, seed: int = 0) -> Path:
    """Processor and model in one directory (the model's ``config.json`` written last)."""
    root.mkdir(parents=True, exist_ok=True)
    make_processor(root)
    return make_model(root, seed)
