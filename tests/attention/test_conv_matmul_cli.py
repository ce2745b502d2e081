"""``mindspeed-flow convert-patch-embed``: checkpoints converted between the conv and the
matmul patch embedding and back (model and optimizer state), what it refuses and how it says
so, and the layout of earlier versions."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mindspeed_flow.attention import conv_matmul_cli
from mindspeed_flow.attention.patch_embed import PatchEmbedMatmul
from tests.attention.test_patch_embed import StandInPatchEmbed


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="mindspeed-flow")
    conv_matmul_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def megatron_like_checkpoint() -> dict:
    torch.manual_seed(1)
    conv = nn.Conv3d(3, 16, (2, 14, 14), stride=(2, 14, 14), bias=False)
    model = {"image_encoder.encoder.patch_embed.proj.weight": conv.weight.detach().clone(),
             "text_decoder.embedding.word_embeddings.weight": torch.randn(8, 4)}
    return {"iteration": 7, "model": model, "optimizer": {"state": {0: {"exp_avg": torch.zeros(2)}}}}


def test_cli_round_trip_restores_the_upstream_checkpoint(tmp_path, capsys):
    original = megatron_like_checkpoint()
    src, flat, back = tmp_path / "upstream.pt", tmp_path / "matmul.pt", tmp_path / "back.pt"
    torch.save(original, src)
    assert run_cli("convert-patch-embed", str(src), str(flat), "--to", "matmul") == 0
    key = "image_encoder.encoder.patch_embed.proj.weight"
    assert torch.load(flat)["model"][key].shape == (16, 1176)
    assert run_cli("convert-patch-embed", str(flat), str(back), "--to", "conv", "--in-and-kernel", "3,2,14,14") == 0
    restored = torch.load(back)
    assert restored["iteration"] == 7
    for k, v in original["model"].items():
        assert torch.equal(restored["model"][k], v)
    assert "converted 1 weight(s) to conv layout" in capsys.readouterr().out


def test_cli_refusals(tmp_path, capsys):
    src = tmp_path / "ckpt.pt"
    torch.save(megatron_like_checkpoint(), src)
    assert run_cli("convert-patch-embed", str(src), str(tmp_path / "o.pt"), "--to", "conv") == 2
    assert "--in-and-kernel" in capsys.readouterr().out
    assert run_cli("convert-patch-embed", str(src), str(src), "--to", "matmul") == 2
    assert "--force" in capsys.readouterr().out
    # already in conv layout: nothing to convert to conv
    assert run_cli("convert-patch-embed", str(src), str(tmp_path / "o.pt"), "--to", "conv",
                   "--in-and-kernel", "3,2,14,14") == 1
    assert "no patch-embedding weight" in capsys.readouterr().out
    torch.save({"model": {}, "args": argparse.Namespace(x=1)}, tmp_path / "pickled.pt")
    assert run_cli("convert-patch-embed", str(tmp_path / "pickled.pt"), str(tmp_path / "o.pt"),
                   "--to", "matmul") == 2
    assert "--trust-checkpoint" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        run_cli("convert-patch-embed", str(src), str(tmp_path / "o.pt"), "--to", "conv", "--in-and-kernel", "3,x")


def test_reachable_from_the_mindspeed_flow_command(tmp_path):
    from mindspeed_flow.cli import main

    src = tmp_path / "ckpt.pt"
    torch.save(megatron_like_checkpoint(), src)
    assert main(["convert-patch-embed", str(src), str(tmp_path / "flat.pt"), "--to", "matmul"]) == 0


def omni_like_checkpoint() -> dict:
    """A vision patch embedding beside a Whisper-style audio conv1 (kernel 3, padding 1)
    and a CLIP-style conv1 (stride == kernel): names alone do not tell the last two apart."""
    torch.manual_seed(2)
    model = {
        "image_encoder.encoder.patch_embed.proj.weight": nn.Conv3d(3, 16, (2, 14, 14), stride=(2, 14, 14)).weight,
        "audio_encoder.encoder.conv1.weight": nn.Conv1d(128, 16, 3, padding=1).weight,
        "clip.encoder.conv1.weight": nn.Conv2d(3, 16, 14, stride=14, bias=False).weight,
    }
    return {"model": {k: v.detach().clone() for k, v in model.items()}}


def test_cli_to_matmul_flattens_only_known_patch_embeddings_and_names_the_rest(tmp_path, capsys):
    original = omni_like_checkpoint()
    src, out = tmp_path / "omni.pt", tmp_path / "flat.pt"
    torch.save(original, src)
    assert run_cli("convert-patch-embed", str(src), str(out), "--to", "matmul") == 0
    printed = capsys.readouterr().out
    saved = torch.load(out)["model"]
    assert saved["image_encoder.encoder.patch_embed.proj.weight"].shape == (16, 1176)
    for key in ("audio_encoder.encoder.conv1.weight", "clip.encoder.conv1.weight"):
        assert torch.equal(saved[key], original["model"][key])  # left in conv layout
        assert f"{key}: {tuple(original['model'][key].shape)}" in printed
    assert "not converted" in printed and "--key" in printed
    # named explicitly, CLIP's conv1 is converted, and only what was named
    out2 = tmp_path / "clip.pt"
    assert run_cli("convert-patch-embed", str(src), str(out2), "--to", "matmul",
                   "--key", "clip.encoder.conv1.weight") == 0
    saved = torch.load(out2)["model"]
    assert saved["clip.encoder.conv1.weight"].shape == (16, 3 * 14 * 14)
    assert saved["audio_encoder.encoder.conv1.weight"].dim() == 3
    assert saved["image_encoder.encoder.patch_embed.proj.weight"].dim() == 5


def test_cli_refuses_a_checkpoint_with_only_ambiguous_convs(tmp_path, capsys):
    src, out = tmp_path / "whisper.pt", tmp_path / "o.pt"
    torch.save({"model": {"audio_encoder.conv1.weight": nn.Conv1d(128, 16, 3, padding=1).weight.detach()}}, src)
    assert run_cli("convert-patch-embed", str(src), str(out), "--to", "matmul") == 2
    assert "audio_encoder.conv1.weight: (16, 128, 3)" in capsys.readouterr().out
    assert not out.exists()


@pytest.mark.parametrize("in_and_kernel, message", [
    ("3,14,14", "1176 columns cannot split into in_channels x kernel (3, 14, 14)"),
    ("3,2,14,14,1", None),  # four kernel dims: refused by the parser
])
def test_cli_wrong_in_and_kernel_is_a_clean_error(tmp_path, capsys, in_and_kernel, message):
    src, flat, out = tmp_path / "upstream.pt", tmp_path / "flat.pt", tmp_path / "o.pt"
    torch.save(megatron_like_checkpoint(), src)
    assert run_cli("convert-patch-embed", str(src), str(flat), "--to", "matmul") == 0
    capsys.readouterr()
    if message is None:
        with pytest.raises(SystemExit) as exit_info:
            run_cli("convert-patch-embed", str(flat), str(out), "--to", "conv", "--in-and-kernel", in_and_kernel)
        assert exit_info.value.code == 2
        return
    assert run_cli("convert-patch-embed", str(flat), str(out), "--to", "conv", "--in-and-kernel", in_and_kernel) == 2
    printed = capsys.readouterr().out
    assert "image_encoder.encoder.patch_embed.proj.weight" in printed and message in printed
    assert not out.exists()


class EarlierVersionPatchEmbed(nn.Module):
    """What ``--flow-conv-matmul`` trained before the weight kept the conv's shape: the same
    function with the weight stored flat, ``proj.weight`` ``[E, C*prod(kernel)]``."""

    def __init__(self, embed_dim: int = 16) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.randn(embed_dim, 3 * 2 * 14 * 14) * 0.02)

    def forward(self, pixels):
        return F.linear(pixels.reshape(-1, 3 * 2 * 14 * 14), self.proj.weight)


def _adam_step(model, optimizer, seed: int) -> None:
    pixels = torch.randn(6, 3 * 2 * 14 * 14, generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad()
    model(pixels).square().mean().backward()
    optimizer.step()


def test_cli_converts_an_earlier_versions_checkpoint_optimizer_state_included(tmp_path, capsys):
    """An earlier version's ``--ckpt-format torch`` file (flat weight, Adam's moments flat,
    as Megatron's non-distributed optimizer saves them) becomes a checkpoint that upstream's
    model and today's patched model load, and whose optimizer state resumes: the resumed
    step equals the step of the old run that continued."""
    torch.manual_seed(3)
    old = EarlierVersionPatchEmbed()
    old_optimizer = torch.optim.Adam(old.parameters(), lr=1e-2)
    for step in range(2):
        _adam_step(old, old_optimizer, step)
    src, out = tmp_path / "model_optim_rng.pt", tmp_path / "converted.pt"
    torch.save({"iteration": 2, "model": {f"image_encoder.encoder.patch_embed.{k}": v
                                          for k, v in old.state_dict().items()},
                "optimizer": {"optimizer": old_optimizer.state_dict(),
                              "fp32_from_fp16_params": [[old.proj.weight.detach().clone()]]}}, src)
    assert run_cli("convert-patch-embed", str(src), str(out), "--to", "conv", "--in-and-kernel", "3,2,14,14") == 0
    assert "optimizer state: 3 tensor(s)" in capsys.readouterr().out  # exp_avg, exp_avg_sq, main copy
    converted = torch.load(out)
    state = converted["optimizer"]["optimizer"]["state"][0]
    assert state["exp_avg"].shape == state["exp_avg_sq"].shape == (16, 3, 2, 14, 14)
    assert converted["optimizer"]["fp32_from_fp16_params"][0][0].shape == (16, 3, 2, 14, 14)
    assert torch.equal(state["exp_avg"].flatten(), old_optimizer.state_dict()["state"][0]["exp_avg"].flatten())

    weights = {k.removeprefix("image_encoder.encoder.patch_embed."): v for k, v in converted["model"].items()}
    upstream = StandInPatchEmbed(embed_dim=16)
    upstream.load_state_dict(weights, strict=True)
    patched = StandInPatchEmbed(embed_dim=16)
    patched.proj = PatchEmbedMatmul.from_conv(patched.proj)
    patched.load_state_dict(weights, strict=True)
    _adam_step(old, old_optimizer, 2)
    for model in (upstream, patched):
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        optimizer.load_state_dict(torch.load(out)["optimizer"]["optimizer"])  # Adam steps it in place
        _adam_step(model, optimizer, 2)
        torch.testing.assert_close(model.proj.weight.detach().reshape(16, -1), old.proj.weight.detach(),
                                   atol=1e-6, rtol=0)


def test_cli_leaves_an_ambiguous_optimizer_state_and_says_so(tmp_path, capsys):
    """Optimizer states are recognised by shape: another weight of the converted weight's
    old shape makes them ambiguous, and the tool says so instead of guessing."""
    flat = torch.randn(16, 1176)
    src, out = tmp_path / "ckpt.pt", tmp_path / "o.pt"
    torch.save({"model": {"vit.patch_embed.proj.weight": flat, "projector.weight": torch.randn(16, 1176)},
                "optimizer": {"optimizer": {"state": {0: {"exp_avg": torch.zeros(16, 1176)}},
                                            "param_groups": [{"params": [0, 1]}]}}}, src)
    assert run_cli("convert-patch-embed", str(src), str(out), "--to", "conv", "--in-and-kernel", "3,2,14,14") == 0
    printed = capsys.readouterr().out
    assert "optimizer state left as it is" in printed and "projector.weight: (16, 1176)" in printed
    assert "--no-load-optim" in printed
    converted = torch.load(out)
    assert converted["model"]["vit.patch_embed.proj.weight"].shape == (16, 3, 2, 14, 14)
    assert converted["optimizer"]["optimizer"]["state"][0]["exp_avg"].shape == (16, 1176)


def test_cli_names_a_package_the_checkpoint_needs(tmp_path, capsys, monkeypatch):
    """A Megatron checkpoint pickles objects of the training job's packages; where they do
    not import, the tool says which one instead of a traceback."""
    import pickle as pickle_module
    import sys
    import types

    module = types.ModuleType("job_only_package")

    class JobArgs:
        pass

    JobArgs.__module__ = "job_only_package"
    JobArgs.__qualname__ = "JobArgs"
    module.JobArgs = JobArgs
    monkeypatch.setitem(sys.modules, "job_only_package", module)
    src = tmp_path / "ckpt.pt"
    torch.save({"model": {}, "args": JobArgs()}, src, pickle_module=pickle_module)
    monkeypatch.delitem(sys.modules, "job_only_package")
    assert run_cli("convert-patch-embed", str(src), str(tmp_path / "o.pt"), "--to", "conv",
                   "--in-and-kernel", "3,2,14,14", "--trust-checkpoint") == 2
    printed = capsys.readouterr().out
    assert "'job_only_package'" in printed and "PYTHONPATH" in printed
