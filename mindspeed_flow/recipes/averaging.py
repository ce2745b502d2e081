"""Checkpoint weight averaging: ``sum_i w_i * theta_i`` with the weights normalised to 1.

MindVL averages models fine-tuned at different sequence lengths.  Inputs are either all
Megatron torch-format checkpoints (``mp_rank_XX[_YYY]/model_optim_rng.pt`` trees, any
TP/PP, the same for every input) or all Hugging Face safetensors directories.  Inputs
must agree on shard layout, parameter names (in order), shapes and dtypes; the first
difference is named.

Memory: one output shard is accumulated at a time (in fp32, or fp64 for fp64 tensors),
and inputs are read lazily (``torch.load(mmap=True)``, ``safetensors.safe_open``) one
tensor at a time, so the peak stays near one shard, not N models.  The Megatron output
keeps the first input's ``args``, ``iteration`` and ``checkpoint_version`` and drops the
optimizer, scheduler and RNG states, which do not belong to averaged weights (load it with
``--no-load-optim --no-load-rng`` or ``--finetune``).
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from tqdm import tqdm

from .errors import AveragingError

TRACKER = "latest_checkpointed_iteration.txt"
SHARD_FILE = "model_optim_rng.pt"
MODEL_KEY = re.compile(r"model\d*")
KEPT_KEYS = ("args", "checkpoint_version", "iteration")


@dataclass(frozen=True)
class Checkpoint:
    """One input: its format, the directory its shards are relative to, and the shards."""

    path: Path
    kind: str  # "megatron" or "safetensors"
    root: Path
    shards: tuple[str, ...]


def megatron_root(path: Path) -> Path:
    """The iteration directory of a Megatron checkpoint (the tracker file names it)."""
    tracker = path / TRACKER
    if not tracker.exists():
        return path
    text = tracker.read_text().strip()
    return path / ("release" if text == "release" else f"iter_{int(text):07d}")


def open_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if not path.is_dir():
        raise AveragingError(f"{path}: not a directory")
    safetensors = sorted(p.name for p in path.glob("*.safetensors"))
    if safetensors:
        return Checkpoint(path, "safetensors", path, tuple(safetensors))
    root = megatron_root(path)
    shards = tuple(sorted(str(p.relative_to(root)) for p in root.glob(f"mp_rank_*/{SHARD_FILE}")))
    if not shards:
        raise AveragingError(f"{path}: neither *.safetensors files nor Megatron mp_rank_*/{SHARD_FILE} "
                             f"shards under {root}")
    return Checkpoint(path, "megatron", root, shards)


def normalised_weights(weights: Sequence[float] | None, count: int) -> list[float]:
    if weights is None:
        return [1.0 / count] * count
    if len(weights) != count:
        raise AveragingError(f"--weights: {len(weights)} weight(s) for {count} input(s)")
    bad = [w for w in weights if not w > 0]
    if bad:
        raise AveragingError(f"--weights: {bad[0]} is not a positive number")
    total = sum(weights)
    return [w / total for w in weights]


def check_layouts(checkpoints: Sequence[Checkpoint]) -> None:
    first = checkpoints[0]
    for other in checkpoints[1:]:
        if other.kind != first.kind:
            raise AveragingError(f"{other.path} is a {other.kind} checkpoint, {first.path} a {first.kind} one")
        if other.shards != first.shards:
            missing = sorted(set(first.shards) - set(other.shards))
            extra = sorted(set(other.shards) - set(first.shards))
            what = f"lacks shard {missing[0]}" if missing else f"has extra shard {extra[0]}"
            raise AveragingError(f"parallel layouts differ: {other.path} {what} of {first.path} "
                                 "(all inputs must share TP/PP)")


def check_same_tensors(where: str, first: Path, other: Path, a: dict[str, Any], b: dict[str, Any]) -> None:
    """Names in order, then shapes and dtypes; raises at the first difference."""
    names_a, names_b = list(a), list(b)
    for i, (x, y) in enumerate(zip(names_a, names_b)):
        if x != y:
            raise AveragingError(f"{where}: parameter names differ at #{i}: {other} has {y!r}, {first} has {x!r}")
    if len(names_a) != len(names_b):
        longer, path = (names_a, first) if len(names_a) > len(names_b) else (names_b, other)
        raise AveragingError(f"{where}: only {path} has {longer[min(len(names_a), len(names_b))]!r}")
    for name in names_a:
        ta, tb = a[name], b[name]
        if isinstance(ta, torch.Tensor) != isinstance(tb, torch.Tensor):
            raise AveragingError(f"{where}: {name!r} is a tensor in only one of {first}, {other}")
        if isinstance(ta, torch.Tensor) and (ta.shape != tb.shape or ta.dtype != tb.dtype):
            raise AveragingError(f"{where}: {name!r} is {tuple(tb.shape)} {tb.dtype} in {other}, "
                                 f"{tuple(ta.shape)} {ta.dtype} in {first}")


def accumulator_dtype(tensor: torch.Tensor) -> torch.dtype:
    return torch.float64 if tensor.dtype == torch.float64 else torch.float32


class Accumulator:
    """Running weighted sums of one shard's floating tensors; other entries from the first input."""

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.dtypes: dict[str, torch.dtype] = {}

    def add(self, name: str, value: Any, weight: float) -> None:
        if not (isinstance(value, torch.Tensor) and value.is_floating_point()):
            self.sums.setdefault(name, value)
            return
        term = value.to(accumulator_dtype(value)) * weight
        if name in self.sums:
            self.sums[name].add_(term)
        else:
            self.sums[name], self.dtypes[name] = term, value.dtype

    def result(self) -> dict[str, Any]:
        return {n: v.to(self.dtypes[n]) if n in self.dtypes else v for n, v in self.sums.items()}


def _megatron_models(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {k: v for k, v in state.items() if MODEL_KEY.fullmatch(k)}


def average_megatron_shard(checkpoints: Sequence[Checkpoint], weights: Sequence[float], shard: str) -> dict[str, Any]:
    first = checkpoints[0]
    sums: dict[str, Accumulator] = {}
    template: dict[str, Any] = {}
    reference: dict[str, dict[str, Any]] = {}
    for ckpt, weight in zip(checkpoints, weights):
        state = torch.load(ckpt.root / shard, map_location="cpu", mmap=True, weights_only=False)
        models = _megatron_models(state)
        if ckpt is first:
            template = {k: state[k] for k in KEPT_KEYS if k in state}
            reference = {k: {n: _meta(t) for n, t in m.items()} for k, m in models.items()}
        else:
            check_same_tensors(f"{shard} model chunks", first.path, ckpt.path,
                               {k: None for k in reference}, {k: None for k in models})
            for key, model in models.items():
                check_same_tensors(f"{shard} [{key}]", first.path, ckpt.path, reference[key],
                                   {n: _meta(t) for n, t in model.items()})
        for key, model in models.items():
            acc = sums.setdefault(key, Accumulator())
            for name, value in model.items():
                acc.add(name, value, weight)
        del state, models
    return {**template, **{key: acc.result() for key, acc in sums.items()}}


def _meta(value: Any) -> Any:
    """What the checks compare, without keeping the tensor's data alive."""
    return torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, torch.Tensor) else value


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


def _slice_meta(piece: Any) -> torch.Tensor:
    """Shape and dtype of a safetensors entry without reading its data."""
    return torch.empty(piece.get_shape(), dtype=_SAFETENSORS_DTYPES[piece.get_dtype()], device="meta")


def average_safetensors_shard(checkpoints: Sequence[Checkpoint], weights: Sequence[float], shard: str) -> dict[str, Any]:
    from safetensors import safe_open

    handles = [safe_open(str(c.root / shard), framework="pt") for c in checkpoints]
    metas = [{k: _slice_meta(h.get_slice(k)) for k in h.keys()} for h in handles]
    for ckpt, meta in zip(checkpoints[1:], metas[1:]):
        check_same_tensors(shard, checkpoints[0].path, ckpt.path, metas[0], meta)
    acc = Accumulator()
    for name in metas[0]:
        for handle, weight in zip(handles, weights):
            acc.add(name, handle.get_tensor(name), weight)
    return acc.result()


def shards(checkpoints: Sequence[Checkpoint], weights: Sequence[float]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(shard, averaged state)`` one shard at a time."""
    average = average_megatron_shard if checkpoints[0].kind == "megatron" else average_safetensors_shard
    for shard in tqdm(checkpoints[0].shards, desc="averaging shards", unit="shard"):
        yield shard, average(checkpoints, weights, shard)


def average_checkpoints(out: str | Path, inputs: Sequence[str | Path], weights: Sequence[float] | None = None) -> Path:
    """Write the weighted average of ``inputs`` to ``out`` (which must not hold files)."""
    out = Path(out)
    if len(inputs) < 2:
        raise AveragingError("average-checkpoints needs at least two inputs")
    if out.exists() and any(out.iterdir()):
        raise AveragingError(f"{out}: output directory exists and is not empty")
    checkpoints = [open_checkpoint(p) for p in inputs]
    check_layouts(checkpoints)
    norm = normalised_weights(weights, len(checkpoints))
    first = checkpoints[0]
    out_root = out / first.root.relative_to(first.path)
    for shard, state in shards(checkpoints, norm):
        target = out_root / shard
        target.parent.mkdir(parents=True, exist_ok=True)
        if first.kind == "megatron":
            torch.save(state, target)
        else:
            from safetensors import safe_open
            from safetensors.torch import save_file

            with safe_open(str(first.root / shard), framework="pt") as handle:
                metadata = handle.metadata()
            save_file(state, str(target), metadata=metadata)
    _copy_side_files(first, out)
    return out


def _copy_side_files(first: Checkpoint, out: Path) -> None:
    """Config, tokenizer, index (safetensors) or the tracker file (Megatron) of the first input."""
    for item in first.path.iterdir():
        if item.is_file() and item.suffix not in (".safetensors", ".pt"):
            shutil.copy2(item, out / item.name)
