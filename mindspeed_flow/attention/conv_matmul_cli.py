"""``mindspeed-flow convert-patch-embed``: patch-embedding weights of a saved checkpoint,
conv layout <-> flat (matmul) layout.

A model trained with ``--flow-conv-matmul`` saves its patch embedding in the conv layout
``[E, C, *kernel]``, as upstream MindSpeed-MM does: its checkpoints need no conversion.
Earlier versions of mindspeed-flow saved the weight flat, ``[E, C*prod(kernel)]``; ``--to
conv`` turns such a ``--ckpt-format torch`` file into the layout that upstream and this
version load, ``--to matmul`` goes the other way (for an earlier mindspeed-flow, or other
flat-layout code).

A conv weight does not record its stride or padding, so ``--to matmul`` flattens only
weights known to be patch embeddings (``patch_embed.proj.weight``) or named by ``--key``,
and names every other ``conv1.weight`` it leaves as it is.

Handles ``torch.save`` files (Megatron's ``--ckpt-format torch``: ``model``, ``model0``,
... dicts, or a bare state dict), walking nested dicts, and Hugging Face ``.safetensors``
files (the checkpoints of ``pretrain_transformers.py``'s Qwen3-VL, whose ViT patch embedding is
``model.visual.patch_embed.proj.weight``, ``[E, 3, 2, 16, 16]``; a sharded directory is
converted one shard file at a time: its index names keys, not shapes).  A ``.safetensors``
file keeps its metadata.  A Qwen3-VL HF directory needs no conversion for
``--flow-conv-matmul``: the plugin's patch embedding keeps the conv's shape.  The optimizer state in the same file
(the ``optimizer`` entry: Adam's moments and the fp32 main copies of a non-distributed
optimizer, which have their parameter's shape) is converted too: every tensor there whose
shape is a converted weight's old shape, provided no other weight of the model has that
shape (else the optimizer state is left as it is, named, and ``--no-load-optim`` is the way
to resume).  The distributed optimizer's ``distrib_optim.pt`` holds flat buffers that do not
depend on the layout: nothing to convert.  ``torch_dist`` checkpoints of every version hold
the conv layout.
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from .patch_embed import conv_to_matmul_state, matmul_to_conv_state

# Weight names of the patch embeddings the conv_matmul feature replaces.
DEFAULT_SUFFIXES = ("patch_embed.proj.weight", "conv1.weight")
# A checkpoint records no stride or padding, so a conv weight is flattened only where its
# name says it is a stride == kernel, unpadded convolution: MindSpeed-MM's ``PatchEmbed.proj``
# (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) is built ``nn.Conv3d(..., stride=kernel_size)``.  A
# ``conv1.weight`` may be CLIP's patch embedding (stride == kernel) or something else, e.g.
# Whisper's and MindSpeed-MM's audio ``conv1`` (kernel 3, padding 1): never flattened
# unless named by ``--key``.
PATCH_EMBED_SUFFIXES = ("patch_embed.proj.weight",)


def register(subparsers: Any) -> None:
    """Add the ``convert-patch-embed`` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "convert-patch-embed",
        help="convert patch-embedding weights of a checkpoint between conv and matmul layouts",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("input", type=Path, help="checkpoint file written by torch.save, or a .safetensors file")
    parser.add_argument("output", type=Path, help="where to write the converted checkpoint (in the format of the input)")
    parser.add_argument("--to", choices=("conv", "matmul"), required=True, help="target layout")
    parser.add_argument(
        "--key", action="append", default=None,
        help=f"state-dict key of a weight to convert (repeatable); default: keys ending in "
             f"{' or '.join(DEFAULT_SUFFIXES)}, except that --to matmul flattens only "
             f"{' and '.join(PATCH_EMBED_SUFFIXES)} by default and names the others it leaves",
    )
    parser.add_argument(
        "--in-and-kernel", type=_shape, default=None, metavar="C,K1[,K2[,K3]]",
        help="input channels and kernel of the conv, e.g. 3,2,14,14 for Qwen2-VL, 3,2,16,16 for Qwen3-VL "
             "(required with --to conv: a flat weight does not say how to split)",
    )
    parser.add_argument(
        "--trust-checkpoint", action="store_true",
        help="unpickle arbitrary objects (Megatron checkpoints hold argparse Namespaces); "
             "only for checkpoints you trust",
    )
    parser.add_argument("--force", action="store_true", help="overwrite an existing output file")
    parser.set_defaults(func=convert_command)


def _shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not 2 <= len(dims) <= 4 or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"expected C and 1 to 3 kernel sizes, all positive, got {text!r}")
    return dims


def convert_command(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Run the conversion; returns the process exit code (messages go to stdout).

    ``argv`` is part of the ``mindspeed-flow`` subcommand contract (``func(args, argv)``);
    everything this command needs is already parsed into ``args``.
    """
    if args.to == "conv" and args.in_and_kernel is None:
        print("convert-patch-embed: --to conv needs --in-and-kernel (e.g. 3,2,14,14)")
        return 2
    if args.output.exists() and not args.force:
        print(f"convert-patch-embed: {args.output} exists; pass --force to overwrite")
        return 2
    metadata = None
    try:
        if _is_safetensors(args.input):
            checkpoint, metadata = _load_safetensors(args.input)
        else:
            checkpoint = torch.load(args.input, map_location="cpu", weights_only=not args.trust_checkpoint)
    except pickle.UnpicklingError as err:
        print(f"convert-patch-embed: {args.input} holds objects beyond tensors ({err}); "
              "rerun with --trust-checkpoint if you trust it")
        return 2
    except ModuleNotFoundError as err:
        print(f"convert-patch-embed: {args.input} pickles objects of {err.name!r} (Megatron checkpoints keep "
              "their arguments); run this where the training job's packages import (MindSpeed-MM, MindSpeed, "
              "Megatron on PYTHONPATH)")
        return 2
    converted: list[str] = []
    refused: list[str] = []
    reshaped: dict[tuple[int, ...], tuple[int, ...]] = {}  # old shape -> new shape
    # the model's weights: everything but the optimizer entry, whose dicts are walked below
    model_part = [v for k, v in checkpoint.items() if not _is_optimizer_entry(k)] \
        if isinstance(checkpoint, dict) and any(_is_optimizer_entry(k) for k in checkpoint) else checkpoint
    for state in _state_dicts(model_part):
        candidates = [k for k in state if _selected(k, args.key) and _needs(state[k], args.to)]
        keys = [k for k in candidates if args.to == "conv" or args.key or k.endswith(PATCH_EMBED_SUFFIXES)]
        refused += [f"{k}: {tuple(state[k].shape)}" for k in candidates if k not in keys]
        if not keys:
            continue
        try:
            if args.to == "matmul":
                new = conv_to_matmul_state(state, keys)
            else:
                new = matmul_to_conv_state(state, keys, args.in_and_kernel)
        except (KeyError, ValueError) as err:
            print(f"convert-patch-embed: {args.input}: {err.args[0]}")
            return 2
        for key in keys:
            reshaped[tuple(state[key].shape)] = tuple(new[key].shape)
            state[key] = new[key]
            converted.append(f"{key}: {tuple(new[key].shape)}")
    if refused:
        print("convert-patch-embed: not converted, the checkpoint does not say these convolutions have "
              "stride == kernel and no padding (CLIP's conv1 has; an audio conv1 with kernel 3, padding 1 "
              "has not); pass --key NAME for each one that is a patch embedding:")
        for line in refused:
            print(f"  {line}")
    if not converted:
        if refused:
            return 2
        print(f"convert-patch-embed: no patch-embedding weight to convert to {args.to} layout in "
              f"{args.input} (already converted, or pass --key)")
        return 1
    optimizer_note = _convert_optimizer_state(checkpoint, model_part, reshaped)
    if metadata is not None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in checkpoint.items()}, str(args.output), metadata=metadata)
    else:
        torch.save(checkpoint, args.output)
    print(f"converted {len(converted)} weight(s) to {args.to} layout -> {args.output}")
    for line in converted:
        print(f"  {line}")
    if optimizer_note:
        print(optimizer_note)
    return 0


def _is_safetensors(path: Path) -> bool:
    return path.suffix == ".safetensors"


def _load_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors of a ``.safetensors`` file and its metadata (``{}`` when it has none)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata() or {}


def _is_optimizer_entry(key: Any) -> bool:
    """Megatron's ``torch`` checkpoint keeps the optimizer under ``optimizer`` (its
    ``state``, ``param_groups`` and ``fp32_from_fp16_params``)."""
    return isinstance(key, str) and key.startswith("optimizer")


def _convert_optimizer_state(checkpoint: Any, model_part: Any,
                             reshaped: dict[tuple[int, ...], tuple[int, ...]]) -> str:
    """Reshape the optimizer state of the converted weights in place; returns what was
    done, in words ("" when the checkpoint has no optimizer entry)."""
    entries = [k for k in checkpoint if _is_optimizer_entry(k)] if isinstance(checkpoint, dict) else []
    if not entries or not reshaped:
        return ""
    # An optimizer state is recognised by its shape: sound only if no weight left as it is
    # has the shape a converted one had.
    clashes = sorted({f"{k}: {tuple(v.shape)}" for state in _state_dicts(model_part) for k, v in state.items()
                      if isinstance(v, torch.Tensor) and tuple(v.shape) in reshaped})
    if clashes:
        return ("optimizer state left as it is: other weights have the shape of a converted one, so "
                "their optimizer states cannot be told apart (" + "; ".join(clashes) + "); "
                "resume with --no-load-optim")
    count = 0

    def convert(value: Any) -> Any:
        nonlocal count
        if isinstance(value, torch.Tensor) and tuple(value.shape) in reshaped:
            count += 1
            return value.reshape(reshaped[tuple(value.shape)]).clone()
        if isinstance(value, dict):
            for k in value:
                value[k] = convert(value[k])
        elif isinstance(value, list):
            value[:] = [convert(v) for v in value]
        elif type(value) is tuple:
            return tuple(convert(v) for v in value)
        return value

    for key in entries:
        checkpoint[key] = convert(checkpoint[key])
    return f"  optimizer state: {count} tensor(s) of the converted weight(s) reshaped alike"


def _selected(key: Any, keys: list[str] | None) -> bool:
    if not isinstance(key, str):  # optimizer states are keyed by parameter index
        return False
    return key in keys if keys else key.endswith(DEFAULT_SUFFIXES)


def _needs(value: Any, to: str) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    return value.dim() >= 3 if to == "matmul" else value.dim() == 2


def _state_dicts(obj: Any) -> Iterator[dict]:
    """Every dict inside ``obj`` that holds tensors directly (a state dict or part of one)."""
    if isinstance(obj, dict):
        if any(isinstance(v, torch.Tensor) for v in obj.values()):
            yield obj
        for value in obj.values():
            yield from _state_dicts(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _state_dicts(value)
