"""MindSpeed-MM's real ``Qwen3VLViT``, one forward and backward on CPU, without
``--use-flash-attn``: what a job meets, with or without the plugin.

Run by ``test_qwen3vl_vit.py`` (beside it) in a subprocess (never imported by pytest):
``python driver.py ARGS`` for upstream as it is, ``python -m mindspeed_flow.launch
driver.py ARGS --flow-fused-attn`` with the plugin.  MindSpeed's adaptor is imported
first, as ``pretrain_vlm.py`` does; Megatron (the copy inside the MindSpeed-MM tree) is
initialised by its own ``initialize_megatron``; the ViT is built from MindSpeed-MM's own
``get_qwen3vl_layer_spec``.  Only ``torch_npu`` / ``torchair`` are stood in (the folder on
``PYTHONPATH`` first).  Before the forward it may load and save a ``torch_dist`` checkpoint (see :func:`checkpoint`).
Writes, to the path in ``MINDSPEED_FLOW_QWEN3VL_OUT``: the output,
the parameter gradients, the plugin's patch statuses, and every tensor any aten op returned whose last two dimensions
both span the whole pack (a ``[.., S, S]`` mask or score matrix).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent / "support"))  # tests/support: dist_checkpoint_compat
import mindspeed.megatron_adaptor  # noqa: F401  (first: MindSpeed patches Megatron at import)
import torch
from torch.utils._python_dispatch import TorchDispatchMode

GRID_THW = [[1, 4, 4], [1, 2, 4], [1, 2, 2]]  # three images: 16 + 8 + 4 patches
PATCH = 2
TEMPORAL = 2
CHANNELS = 3


class PackSquareTensors(TorchDispatchMode):
    """Records ``(op, shape)`` of every op output whose last two dims are both ``tokens``."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.seen: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(item, torch.Tensor) and item.dim() >= 2 and tuple(item.shape[-2:]) == (self.tokens,) * 2:
                self.seen.append((str(func), list(item.shape)))
        return out


def initialise() -> None:
    import megatron.training.initialize as megatron_init

    # Runs `make` on Megatron's dataset helpers inside the upstream tree; no dataset here.
    megatron_init._compile_dependencies = lambda: None
    megatron_init.initialize_megatron(args_defaults={"dataloader_type": "external"})


def build_vit():
    """A two-layer Qwen3VLViT from Megatron's args plus the vision fields MindSpeed-MM's
    model JSON carries (tiny sizes)."""
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args
    from mindspeed_mm.models.common.module_spec.qwen3vl_layer_spec import get_qwen3vl_layer_spec
    from mindspeed_mm.models.vision.vision_encoders.qwen3vl_vit_model import Qwen3VLViT

    config = core_transformer_config_from_args(get_args())
    for name, value in dict(spatial_merge_size=2, patch_size=PATCH, temporal_patch_size=TEMPORAL,
                            in_channels=CHANNELS, add_bias_conv=True, max_position_embeddings=16,
                            deepstack_visual_indexes=[], fullatt_block_indexes=[],
                            pipeline_num_layers=[config.num_layers]).items():
        setattr(config, name, value)
    torch.manual_seed(int(os.environ.get("MINDSPEED_FLOW_QWEN3VL_SEED", "1234")))
    return Qwen3VLViT(config, get_qwen3vl_layer_spec(config, is_vit=True))


def checkpoint(model) -> dict[str, torch.Tensor]:
    """``torch_dist`` (Megatron's distributed checkpoint): load the folder named by
    ``MINDSPEED_FLOW_QWEN3VL_LOAD``, then save to ``MINDSPEED_FLOW_QWEN3VL_SAVE``; returns
    the saved tensors as Megatron reads them back without a model (empty if none saved)."""
    from megatron.core import dist_checkpointing

    from dist_checkpoint_compat import bind_serialization_format

    if os.environ.get("MINDSPEED_FLOW_QWEN3VL_LOAD"):
        loaded = dist_checkpointing.load(model.sharded_state_dict(), os.environ["MINDSPEED_FLOW_QWEN3VL_LOAD"])
        model.load_state_dict(loaded, strict=True)
    if os.environ.get("MINDSPEED_FLOW_QWEN3VL_SAVE"):
        folder = Path(os.environ["MINDSPEED_FLOW_QWEN3VL_SAVE"])
        folder.mkdir(parents=True)  # as Megatron's save_checkpoint makes it
        bind_serialization_format()
        dist_checkpointing.save(model.sharded_state_dict(), str(folder))
        return dict(dist_checkpointing.load_plain_tensors(str(folder)))
    return {}


def main() -> None:
    initialise()
    model = build_vit()
    saved = checkpoint(model)
    grid = torch.tensor(GRID_THW)
    tokens = int(grid.prod(dim=1).sum())
    gen = torch.Generator().manual_seed(7)
    pixels = torch.randn(tokens, CHANNELS * TEMPORAL * PATCH * PATCH, generator=gen)
    with PackSquareTensors(tokens) as recorder:
        hidden, _, _ = model(pixels, grid)
        hidden.float().square().sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    modules = {name: type(module).__name__ for name, module in model.named_modules() if name.endswith("patch_embed.proj")}
    torch.save({"output": hidden.detach().float().clone(), "grads": grads, "tokens": tokens,
                "pack_square": recorder.seen, "patches": patch_statuses(), "saved": saved,
                "modules": modules}, os.environ["MINDSPEED_FLOW_QWEN3VL_OUT"])


def patch_statuses() -> dict[str, str]:
    """``target -> status`` of the plugin's patches; empty when the plugin is not active."""
    from mindspeed_flow.activation import current_registry

    registry = current_registry()
    return {} if registry is None else {row.target: row.status for row in registry.report()}


if __name__ == "__main__":
    main()
