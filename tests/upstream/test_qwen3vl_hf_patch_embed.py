"""``conv_matmul`` on ``pretrain_transformers.py``'s Qwen3-VL: MindSpeed-MM's own Hugging Face ViT
(``mindspeed_mm/models/transformers/qwen3vl``: ``Qwen3VLVisionModel``, whose
``Qwen3VLVisionPatchEmbed.proj`` is a Conv3d with kernel = stride = (2, 16, 16)), tiny, fp32.

Two runs of ``qwen3vl_hf_patch_embed_driver.py`` on the pinned sources (``torch_npu`` /
``torchair`` stood in, MindSpeed's adaptor imported first; the recipe's ``flash_attention_2`` TND
attention): upstream as is writes random weights in HF format (``save_pretrained``), and the
plugin (``-m mindspeed_flow.launch ... --flow-conv-matmul``) loads that directory with
``from_pretrained``, unconverted, and saves it again.  Two images and a two-frame clip (32 patches),
DeepStack merger included.

Asserted: the patch is applied and the ViT's patch embedding is the matmul, on the conv's
parameter shape; output, DeepStack features, input gradient and every parameter gradient equal
upstream's (fp32, 1e-5 absolute; both sides compute the same products in another order: measured
here 1.9e-6 on outputs of magnitude ~2.5, 2.8e-7 on gradients); the HF safetensors the plugin
saves are upstream's, bit for bit; and ``convert-patch-embed`` takes that file to the flat layout
and back exactly.

Trained from scratch (no checkpoint): the model built from its config with the same seed has
upstream's weights, patch embedding included, bit for bit, after HF's ``post_init`` and after
MindSpeed-MM's meta-device re-init (``to_empty`` + ``init_weights``).  The patched conv stays
a ``Conv3d`` (``MatmulConv3d``), which HF's init finds by ``isinstance``; a
``PatchEmbedMatmul`` there kept torch's default init and shifted every later module's draws.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import torch

from harness import upstream_env
from pinned_upstream import upstream_sources

DRIVER = Path(__file__).resolve().parent / "qwen3vl_hf_patch_embed_driver.py"
TARGET = "mindspeed_mm.models.transformers.qwen3vl.modules:Qwen3VLVisionPatchEmbed.__init__"
WEIGHT = "patch_embed.proj.weight"
TOL = 1e-5
SEED = "3"


def run_vit(workdir: Path, plugin: bool, **env: str) -> dict:
    workdir.mkdir(parents=True)
    out = workdir / "vit.pt"
    environ = upstream_env(upstream_sources(), workdir)
    environ.update({"QWEN3VL_HF_OUT": str(out), **env})
    launcher = ["-m", "mindspeed_flow.launch"] if plugin else []
    command = [sys.executable, *launcher, str(DRIVER), *(["--flow-conv-matmul"] if plugin else [])]
    proc = subprocess.run(command, cwd=workdir, env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out, weights_only=False)


def convert(*argv: str) -> int:
    from mindspeed_flow.attention import conv_matmul_cli

    parser = argparse.ArgumentParser(prog="mindspeed-flow")
    conv_matmul_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_matmul_patch_embedding_equals_the_conv_on_the_hf_qwen3vl_vit(runs, tmp_path):
    """``runs`` (conftest) is taken for its environment check only."""
    from safetensors.torch import load_file

    upstream_dir, ours_dir = tmp_path / "hf_upstream", tmp_path / "hf_ours"
    plain = run_vit(tmp_path / "plain", plugin=False, QWEN3VL_HF_SAVE=str(upstream_dir))
    ours = run_vit(tmp_path / "ours", plugin=True, QWEN3VL_HF_IN=str(upstream_dir), QWEN3VL_HF_SAVE=str(ours_dir))
    assert plain["patch_embed"] == "Conv3d" and plain["patches"] == {}
    assert ours["patch_embed"] == "MatmulConv3d" and ours["patches"][TARGET] == "applied"
    torch.testing.assert_close(ours["output"], plain["output"], atol=TOL, rtol=0)
    assert len(plain["deepstack"]) == 1
    for theirs, mine in zip(plain["deepstack"], ours["deepstack"], strict=True):
        torch.testing.assert_close(mine, theirs, atol=TOL, rtol=0)
    torch.testing.assert_close(ours["input_grad"], plain["input_grad"], atol=TOL, rtol=0)
    assert ours["grads"].keys() == plain["grads"].keys() and WEIGHT in plain["grads"]
    for name, grad in plain["grads"].items():
        assert ours["grads"][name].shape == grad.shape, name
        torch.testing.assert_close(ours["grads"][name], grad, atol=TOL, rtol=0, msg=name)
    # HF format both ways: loaded unconverted, saved as upstream saves it
    saved_up, saved_ours = load_file(str(upstream_dir / "model.safetensors")), load_file(str(ours_dir / "model.safetensors"))
    assert saved_ours.keys() == saved_up.keys() and saved_up[WEIGHT].shape == (32, 3, 2, 16, 16)
    for key, tensor in saved_up.items():
        assert torch.equal(saved_ours[key], tensor), key
    # the flat layout of earlier versions / other matmul code, and back, exact
    flat, back = tmp_path / "flat.safetensors", tmp_path / "back.safetensors"
    assert convert("convert-patch-embed", str(ours_dir / "model.safetensors"), str(flat), "--to", "matmul") == 0
    assert load_file(str(flat))[WEIGHT].shape == (32, 1536)
    assert convert("convert-patch-embed", str(flat), str(back), "--to", "conv", "--in-and-kernel", "3,2,16,16") == 0
    restored = load_file(str(back))
    assert restored.keys() == saved_up.keys() and all(torch.equal(restored[k], v) for k, v in saved_up.items())


def test_a_model_built_from_its_config_is_initialised_as_upstream(runs, tmp_path):
    """Same seed, no checkpoint: every weight bit for bit upstream's, the patch embedding's too."""
    plain = run_vit(tmp_path / "plain", plugin=False, QWEN3VL_HF_INIT_ONLY="1", QWEN3VL_HF_SEED=SEED)
    ours = run_vit(tmp_path / "ours", plugin=True, QWEN3VL_HF_INIT_ONLY="1", QWEN3VL_HF_SEED=SEED)
    assert plain["patch_embed"] == "Conv3d" and plain["patches"] == {}
    assert ours["patch_embed"] == "MatmulConv3d" and ours["patches"][TARGET] == "applied"
    for stage in ("post_init", "init_weights"):
        theirs, mine = plain["init"][stage], ours["init"][stage]
        assert mine.keys() == theirs.keys() and WEIGHT in theirs, stage
        for key, tensor in theirs.items():
            assert mine[key].dtype == tensor.dtype and torch.equal(mine[key], tensor), (stage, key)
        # HF's init reached the conv (normal(0, initializer_range 0.02), bias zeroed), not torch's
        # default kaiming-uniform (std 1/sqrt(3 * 1536) = 0.0147, bias nonzero)
        assert abs(theirs[WEIGHT].std().item() - 0.02) < 0.002, stage
        assert not theirs[WEIGHT.replace("weight", "bias")].any(), stage
