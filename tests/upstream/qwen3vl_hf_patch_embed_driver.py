"""The Hugging Face Qwen3-VL ViT of MindSpeed-MM's ``pretrain_transformers.py`` path
(``mindspeed_mm/models/transformers/qwen3vl``: ``Qwen3VLVisionModel``), one forward and backward
on CPU in fp32, loaded from and saved to an HF directory (``save_pretrained`` safetensors).

Run by ``test_qwen3vl_hf_patch_embed.py`` (beside it) in a subprocess, never imported by pytest:
``python driver.py`` for upstream as it is, ``python -m mindspeed_flow.launch driver.py
--flow-conv-matmul`` with the plugin.  Only ``torch_npu`` / ``torchair`` are stood in (the folder
on ``PYTHONPATH``); MindSpeed's adaptor is imported first, as ``pretrain_transformers.py`` does.

Environment: ``QWEN3VL_HF_IN`` (an HF directory to load; absent: random weights from
``QWEN3VL_HF_SEED``), ``QWEN3VL_HF_INIT_ONLY`` (set: only the weights HF's own init gives a model
built from the config with that seed, no forward), ``QWEN3VL_HF_SAVE`` (where ``save_pretrained`` writes), ``QWEN3VL_HF_OUT``
(a ``torch.save`` file: the output, the DeepStack features, every parameter gradient, the
patch embedding's module class and the plugin's patch statuses).
"""

from __future__ import annotations

import os

import mindspeed.megatron_adaptor  # noqa: F401  (first: MindSpeed patches Megatron at import)
import torch

GRID_THW = [[1, 4, 4], [1, 2, 4], [2, 2, 2]]  # two images and a 2-frame clip: 16 + 8 + 8 patches
CONFIG = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "in_channels": 3,
          "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 48,
          "num_position_embeddings": 16, "deepstack_visual_indexes": [0], "hidden_act": "gelu_pytorch_tanh",
          # what MindSpeed-MM's model hub adds to the HF config from the recipe's YAML
          "use_image_mbs_data_balance": False, "attn_layout": "TND", "synchronize_per_layer": False}
# The recipe's attention: MindSpeed-MM's varlen flash-attention entry over the TND pack (the
# torch_npu stand-in's npu_fusion_attention on CPU).
ATTENTION = "flash_attention_2"


def build():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig
    from mindspeed_mm.models.transformers.qwen3vl.modeling_qwen3_vl import Qwen3VLVisionModel

    source = os.environ.get("QWEN3VL_HF_IN")
    if source:
        model = Qwen3VLVisionModel.from_pretrained(source, dtype=torch.float32)
        model.config._attn_implementation = ATTENTION
        return model
    torch.manual_seed(int(os.environ.get("QWEN3VL_HF_SEED", "0")))
    model = Qwen3VLVisionModel._from_config(Qwen3VLVisionConfig(**CONFIG), dtype=torch.float32)
    model.config._attn_implementation = ATTENTION
    if os.environ.get("QWEN3VL_HF_INIT_ONLY"):
        return model
    with torch.no_grad():  # every parameter random (HF's init leaves biases and norms at constants)
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


def hf_init_weights(model) -> dict[str, dict[str, torch.Tensor]]:
    """The weights HF's own init gives ``model`` (built from the config), and its parameters after
    MindSpeed-MM's meta-device sequence redoes it (``to_empty``, ``_is_hf_initialized`` reset,
    ``init_weights``: ``TransformersModel`` and ``_post_fully_shard``): where a module is not
    initialised by type, ``to_empty``'s memory stays.

    ``post_init`` is called here: ``Qwen3VLVisionModel`` leaves it to the model that holds it
    (``Qwen3VLModel.__init__`` calls it, and HF's init recurses into the ViT)."""
    model.post_init()
    after_post_init = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.to_empty(device="cpu")
    for module in model.modules():
        module._is_hf_initialized = False
    model.init_weights()
    return {"post_init": after_post_init,
            "init_weights": {k: v.detach().clone() for k, v in model.named_parameters()}}


def patch_statuses() -> dict[str, str]:
    """The plugin's patches and their status in this process ({} without the plugin)."""
    from mindspeed_flow.activation import current_registry

    registry = current_registry()
    return {} if registry is None else {row.target: row.status for row in registry.report()}


def main() -> None:
    if os.environ.get("QWEN3VL_HF_INIT_ONLY"):
        model = build()
        torch.save({"init": hf_init_weights(model), "patch_embed": type(model.patch_embed.proj).__name__,
                    "patches": patch_statuses()}, os.environ["QWEN3VL_HF_OUT"])
        return
    model = build().float().train()
    grid = torch.tensor(GRID_THW)
    patches = int(grid.prod(dim=1).sum())
    features = CONFIG["in_channels"] * CONFIG["temporal_patch_size"] * CONFIG["patch_size"] ** 2
    pixels = torch.Generator().manual_seed(7)
    pixel_values = torch.randn(patches, features, generator=pixels).requires_grad_(True)
    output = model(pixel_values, grid_thw=grid)
    hidden, deepstack = output if isinstance(output, tuple) else (output, [])
    loss = hidden.pow(2).mean() + sum(d.pow(2).mean() for d in deepstack)
    loss.backward()
    if os.environ.get("QWEN3VL_HF_SAVE"):
        model.save_pretrained(os.environ["QWEN3VL_HF_SAVE"], safe_serialization=True)
    torch.save({
        "output": hidden.detach(), "deepstack": [d.detach() for d in deepstack],
        "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None},
        "input_grad": pixel_values.grad.detach(),
        "patch_embed": type(model.patch_embed.proj).__name__, "patches": patch_statuses(),
    }, os.environ["QWEN3VL_HF_OUT"])


if __name__ == "__main__":
    main()
