"""``mindspeed-flow average-checkpoints`` on Megatron torch-format trees (TP=2 x PP=2) and
Hugging Face safetensors directories: the weighted average, what is kept and dropped, and
the refusals that name the first difference."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mindspeed_flow.cli import main
from mindspeed_flow.recipes.averaging import AveragingError, average_checkpoints

SHARDS = ("mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001")


def model_state(seed: int, shard: str, bad_shape: bool = False) -> dict:
    gen = torch.Generator().manual_seed(seed * 100 + SHARDS.index(shard))
    return {
        "decoder.layers.0.mlp.linear_fc1.weight": torch.randn(8, 4, generator=gen).to(torch.bfloat16),
        "decoder.layers.0.mlp.linear_fc1.bias": torch.randn(8 if not bad_shape else 9, generator=gen),
        "decoder.layers.0.mlp.linear_fc1._extra_state": None,
        "embedding.position_ids": torch.arange(6),
    }


def write_megatron(root: Path, seed: int, shards=SHARDS, bad_shape_in: str | None = None) -> Path:
    (root / "iter_0000100").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text("100")
    for shard in shards:
        (root / "iter_0000100" / shard).mkdir()
        torch.save({"args": argparse.Namespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                    "iteration": 100, "checkpoint_version": 3.0,
                    "model": model_state(seed, shard, bad_shape=shard == bad_shape_in),
                    "optimizer": {"state": {0: torch.zeros(3)}}, "rng_state": [{"random_rng_state": 1}]},
                   root / "iter_0000100" / shard / "model_optim_rng.pt")
    return root


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def test_megatron_weighted_average_via_cli(tmp_path, capsys):
    a, b = write_megatron(tmp_path / "a", 1), write_megatron(tmp_path / "b", 2)
    out = tmp_path / "avg"
    assert main(["average-checkpoints", str(out), str(a), str(b), "--weights", "1", "3"]) == 0
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "100"
    for shard in SHARDS:
        rel = Path("iter_0000100") / shard / "model_optim_rng.pt"
        got, x, y = load(out / rel), load(a / rel), load(b / rel)
        assert "optimizer" not in got and "rng_state" not in got
        assert got["iteration"] == 100 and got["args"].tensor_model_parallel_size == 2
        for name, value in x["model"].items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                expected = (0.25 * value.float() + 0.75 * y["model"][name].float()).to(value.dtype)
                assert got["model"][name].dtype == value.dtype
                assert torch.equal(got["model"][name], expected), (shard, name)
            else:
                assert got["model"][name] is None if value is None else torch.equal(got["model"][name], value)


def write_hf(root: Path, seed: int, extra: str | None = None) -> Path:
    root.mkdir()
    gen = torch.Generator().manual_seed(seed)
    for i in range(2):
        tensors = {f"model.layers.{i}.q_proj.weight": torch.randn(4, 4, generator=gen),
                   f"model.layers.{i}.norm.weight": torch.randn(4, generator=gen).half()}
        if extra and i == 1:
            tensors[extra] = torch.zeros(2)
        save_file(tensors, str(root / f"model-0000{i + 1}-of-00002.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    return root


def test_safetensors_equal_average_keeps_metadata_and_config(tmp_path):
    ins = [write_hf(tmp_path / f"in{s}", s) for s in (1, 2, 3)]
    out = average_checkpoints(tmp_path / "out", ins)
    assert json.loads((out / "config.json").read_text()) == {"model_type": "tiny"}
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        handles = [safe_open(str(p / shard), framework="pt") for p in ins]
        with safe_open(str(out / shard), framework="pt") as got:
            assert got.metadata() == {"format": "pt"}
            for name in handles[0].keys():
                inputs = [h.get_tensor(name) for h in handles]
                expected = sum(t.float() * (1 / 3) for t in inputs).to(inputs[0].dtype)  # fp32, input order
                assert torch.equal(got.get_tensor(name), expected), name


def test_refuses_shape_difference_naming_it(tmp_path):
    a = write_megatron(tmp_path / "a", 1)
    b = write_megatron(tmp_path / "b", 2, bad_shape_in="mp_rank_01_000")
    with pytest.raises(AveragingError, match=r"mp_rank_01_000.*'decoder.layers.0.mlp.linear_fc1.bias' is \(9,\)"):
        average_checkpoints(tmp_path / "out", [a, b])


def test_refuses_other_parallel_layout(tmp_path):
    a = write_megatron(tmp_path / "a", 1)
    b = write_megatron(tmp_path / "b", 2, shards=SHARDS[:2])
    with pytest.raises(AveragingError, match="parallel layouts differ: .*b lacks shard mp_rank_01_000"):
        average_checkpoints(tmp_path / "out", [a, b])


def test_refuses_other_names_and_formats(tmp_path, capsys):
    a, b = write_hf(tmp_path / "a", 1), write_hf(tmp_path / "b", 2, extra="lm_head.weight")
    assert main(["average-checkpoints", str(tmp_path / "o1"), str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert "model-00002-of-00002.safetensors: parameter names differ at #0" in err and "has 'lm_head.weight'" in err
    m = write_megatron(tmp_path / "m", 1)
    with pytest.raises(AveragingError, match="is a megatron checkpoint, .* a safetensors one"):
        average_checkpoints(tmp_path / "o2", [a, m])
    with pytest.raises(AveragingError, match="--weights: 1 weight"):
        average_checkpoints(tmp_path / "o3", [a, a], weights=[1.0])
    (tmp_path / "empty").mkdir()
    with pytest.raises(AveragingError, match="empty: neither"):
        average_checkpoints(tmp_path / "o4", [a, tmp_path / "empty"])
