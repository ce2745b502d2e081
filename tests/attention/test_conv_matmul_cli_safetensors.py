"""``mindspeed-flow convert-patch-embed`` on Hugging Face ``.safetensors`` files, as
``pretrain_transformers.py``'s Qwen3-VL writes them (ViT patch embedding
``model.visual.patch_embed.proj.weight``, a ``[E, 3, 2, 16, 16]`` Conv3d weight): to the flat
matmul layout and back, exact, every other tensor and the file's metadata kept."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.attention.test_conv_matmul_cli import run_cli

KEY = "model.visual.patch_embed.proj.weight"
METADATA = {"format": "pt"}  # what transformers' save_pretrained writes


def qwen3vl_like_shard(path) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    tensors = {KEY: torch.randn(32, 3, 2, 16, 16, generator=generator),
               "model.visual.patch_embed.proj.bias": torch.randn(32, generator=generator),
               "model.visual.blocks.0.attn.qkv.weight": torch.randn(96, 32, generator=generator),
               "lm_head.weight": torch.randn(8, 32, generator=generator).to(torch.bfloat16)}
    save_file(tensors, str(path), metadata=METADATA)
    return tensors


def metadata(path) -> dict:
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata()


def test_safetensors_round_trip_is_exact_and_keeps_the_metadata(tmp_path, capsys):
    original = qwen3vl_like_shard(tmp_path / "model.safetensors")
    flat, back = tmp_path / "flat.safetensors", tmp_path / "back.safetensors"
    assert run_cli("convert-patch-embed", str(tmp_path / "model.safetensors"), str(flat), "--to", "matmul") == 0
    flattened = load_file(str(flat))
    assert flattened[KEY].shape == (32, 3 * 2 * 16 * 16)
    assert torch.equal(flattened[KEY], original[KEY].reshape(32, -1))
    assert run_cli("convert-patch-embed", str(flat), str(back), "--to", "conv", "--in-and-kernel", "3,2,16,16") == 0
    restored = load_file(str(back))
    assert restored.keys() == original.keys()
    for key, tensor in original.items():
        assert restored[key].dtype == tensor.dtype and torch.equal(restored[key], tensor), key
    assert metadata(flat) == METADATA and metadata(back) == METADATA
    out = capsys.readouterr().out
    assert f"{KEY}: (32, 1536)" in out and f"{KEY}: (32, 3, 2, 16, 16)" in out


def test_a_wrong_kernel_for_the_flat_weight_is_refused_by_name(tmp_path, capsys):
    qwen3vl_like_shard(tmp_path / "model.safetensors")
    flat = tmp_path / "flat.safetensors"
    assert run_cli("convert-patch-embed", str(tmp_path / "model.safetensors"), str(flat), "--to", "matmul") == 0
    capsys.readouterr()
    # Qwen2-VL's 14-pixel kernel cannot split Qwen3-VL's 1536 columns
    assert run_cli("convert-patch-embed", str(flat), str(tmp_path / "o.safetensors"), "--to", "conv",
                   "--in-and-kernel", "3,2,14,14") == 2
    assert f"{KEY}: 1536 columns cannot split into in_channels x kernel (3, 2, 14, 14)" in capsys.readouterr().out
    assert not (tmp_path / "o.safetensors").exists()
