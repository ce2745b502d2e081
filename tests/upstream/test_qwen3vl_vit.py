"""Qwen3-VL's ViT without ``--use-flash-attn``: MindSpeed-MM's real ``Qwen3VLViT`` builds a
dense ``[1, S, S]`` block mask over all the images of a batch; with ``fused_attn`` it must
not, and must compute the same thing (issue 8, defect 4).  With ``conv_matmul`` its real
``PatchEmbed`` must load and save Megatron ``torch_dist`` checkpoints in the conv layout
(issue 8, defect 5; since issue 19 the matmul keeps the conv's parameter shape).

Two runs of ``qwen3vl_vit_driver.py`` on the pinned sources (MindSpeed's real adaptor,
Megatron's ``initialize_megatron`` from the MindSpeed-MM tree, the ViT from MindSpeed-MM's
own layer spec; ``torch_npu`` / ``torchair`` stood in, see ``harness.py``): upstream as is,
and through ``mindspeed_flow.launch`` with ``--flow-fused-attn --flow-conv-matmul``.  Three images (28 patch
tokens), fp32, dropout off (the dense kernel and the varlen path draw different masks).

Tolerance: 1e-5 absolute on the output (|y| <= ~4) and on every parameter gradient.  Both
sides are fp32 and compute the same softmax attention, dense-masked against per segment
(the masked entries contribute exact zeros), so they differ only by summation order;
measured here: 1.2e-7 on the output, 1.9e-6 on gradients.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import torch

from harness import upstream_env
from pinned_upstream import upstream_sources

DRIVER = Path(__file__).resolve().parent / "qwen3vl_vit_driver.py"
QWEN3_GET_ARGS = "mindspeed_mm.models.vision.vision_encoders.qwen3vl_vit_model:get_args"
ARGS = (
    "--use-mcore-models", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
    "--micro-batch-size", "1", "--global-batch-size", "1", "--num-layers", "2", "--hidden-size", "32",
    "--num-attention-heads", "2", "--seq-length", "64", "--max-position-embeddings", "64",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128", "--normalization", "RMSNorm", "--swiglu",
    "--no-masked-softmax-fusion", "--lr", "1e-5", "--train-iters", "1", "--seed", "42",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--distributed-backend", "gloo", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
)
TOL = 1e-5
PLUGIN_FLAGS = ("--flow-fused-attn", "--flow-conv-matmul")
PATCH_EMBED = "patch_embed.proj.weight"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_vit(workdir: Path, plugin: bool, **checkpointing: str) -> dict:
    """One driver run; ``checkpointing``: ``SEED``, ``LOAD``, ``SAVE`` (see the driver)."""
    workdir.mkdir(parents=True)
    out = workdir / "vit.pt"
    env = upstream_env(upstream_sources(), workdir)
    env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(_free_port()), "MINDSPEED_FLOW_QWEN3VL_OUT": str(out)})
    env.update({f"MINDSPEED_FLOW_QWEN3VL_{name}": value for name, value in checkpointing.items()})
    launcher = ["-m", "mindspeed_flow.launch"] if plugin else []
    command = [sys.executable, *launcher, str(DRIVER), *ARGS, *(PLUGIN_FLAGS if plugin else [])]
    proc = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return torch.load(out, weights_only=False)


def test_qwen3vl_vit_builds_no_pack_mask_and_computes_the_same(runs, tmp_path):
    """``runs`` (conftest) is taken for its environment check only: skip in the main
    suite's environment, fail under ``scripts/test_upstream.sh`` if a dependency is missing.

    The plugin run (fused_attn and conv_matmul) starts from other random weights and loads
    the plain run's ``torch_dist`` checkpoint: equal outputs need that load to have worked
    into the matmul patch embedding (issue 8, defect 5, on MindSpeed-MM's real
    ``PatchEmbed``); the checkpoint it saves holds the conv layout and the same numbers.
    """
    plain = run_vit(tmp_path / "plain", plugin=False, SAVE=str(tmp_path / "ckpt_plain"))
    ours = run_vit(tmp_path / "ours", plugin=True, SEED="99", LOAD=str(tmp_path / "ckpt_plain"),
                   SAVE=str(tmp_path / "ckpt_ours"))
    upstream_weight = plain["saved"][PATCH_EMBED]
    assert upstream_weight.dim() == 5
    torch.testing.assert_close(ours["saved"][PATCH_EMBED], upstream_weight, atol=0, rtol=0)
    assert ours["saved"].keys() == plain["saved"].keys()
    tokens = plain["tokens"]
    assert tokens == 28
    # upstream as is: the dense block mask over the whole pack, and its [heads, S, S] scores
    assert ("aten.full.default", [1, tokens, tokens]) in plain["pack_square"]
    assert plain["patches"] == {}
    # with the plugin nothing spans the pack: the ViT's own get_args view is in place
    assert ours["pack_square"] == []
    assert ours["patches"][QWEN3_GET_ARGS] == "applied"
    torch.testing.assert_close(ours["output"], plain["output"], atol=TOL, rtol=0)
    assert ours["grads"].keys() == plain["grads"].keys() and len(plain["grads"]) > 10
    for name, grad in plain["grads"].items():
        other = ours["grads"][name]
        torch.testing.assert_close(other.reshape(grad.shape), grad, atol=TOL, rtol=0, msg=name)
    # the matmul was really in use, on the conv's own parameter shape (issue 19, defect 3)
    assert list(ours["modules"].values()) == ["PatchEmbedMatmul"] and list(plain["modules"].values()) == ["Conv3d"]
    assert ours["grads"][PATCH_EMBED].shape == plain["grads"][PATCH_EMBED].shape
