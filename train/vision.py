"""The tiny VLM's vision encoder: a Qwen2-VL-like ViT over the loader's ``[N, 1176]`` patch rows.

Patch embedding as upstream (Conv3d) or as :class:`~mindspeed_flow.attention.patch_embed.PatchEmbedMatmul`,
pre-norm blocks whose attention stays inside each image (one dense block-diagonal mask, or
varlen attention over the images' ``cu_seqlens``), and Qwen2-VL's 2x2 merger + projector.
The four variants compute the same function from the same weights (:func:`init_vision_encoder`),
which is what lets the job compare the baseline's ViT with FlowTrain's.

Plain PyTorch (no megatron-core): the runtime's fast tests run it as their encoder region too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from mindspeed_flow.attention.patch_embed import replace_conv
from mindspeed_flow.attention.varlen import varlen_attention
from mindspeed_flow.data.images import MERGE, PATCH, TEMPORAL_PATCH

from .parts import INIT_STD, ModelConfig, init_by_name

if TYPE_CHECKING:
    from .batches import ModelBatch

CHANNELS = 3
KERNEL = (TEMPORAL_PATCH, PATCH, PATCH)  # one row of the loader = one Conv3d window
PATCH_ROW = CHANNELS * TEMPORAL_PATCH * PATCH * PATCH  # 1176: the width of a loader patch row


def image_cu_seqlens(image_grid_thw: torch.Tensor) -> torch.Tensor:
    """``[I + 1]`` int32 boundaries of each image's ``t*h*w`` patch rows."""
    sizes = image_grid_thw.reshape(-1, 3).prod(dim=1)
    return torch.cat([sizes.new_zeros(1), sizes.cumsum(0)]).to(torch.int32)


def image_block_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """``[N, N]`` bool, True where a patch may attend (same image): the dense mask
    MindSpeed-MM's ViT builds when flash attention is off."""
    image = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1, device=cu_seqlens.device),
                                    cu_seqlens.diff().long())
    return image[:, None] == image[None, :]


class VisionAttention(nn.Module):
    """Multi-head self-attention restricted to each image (no causality)."""

    def __init__(self, hidden: int, heads: int, *, varlen: bool) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"vit_hidden {hidden} is not a multiple of vit_heads {heads}")
        self.heads, self.varlen = heads, varlen
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        n, hidden = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.heads, hidden // self.heads).unbind(1)
        if self.varlen:
            out = varlen_attention(q, k, v, cu_seqlens, cu_seqlens, causal=False)
        else:
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
            scores = scores.masked_fill(~image_block_mask(cu_seqlens), float("-inf"))
            out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
        return self.proj(out.reshape(n, hidden))


class VisionBlock(nn.Module):
    """Pre-norm transformer block (attention, then a GELU MLP of 4x width)."""

    def __init__(self, hidden: int, heads: int, *, varlen: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = VisionAttention(hidden, heads, varlen=varlen)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Qwen2-VL's merger: each 2x2 group of patches (consecutive rows, the loader's merge
    order) becomes one LLM token through LayerNorm and a 2-layer MLP projector."""

    def __init__(self, vit_hidden: int, llm_hidden: int) -> None:
        super().__init__()
        width = vit_hidden * MERGE * MERGE
        self.norm = nn.LayerNorm(vit_hidden)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, llm_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x).reshape(-1, x.shape[-1] * MERGE * MERGE))


class VisionEncoder(nn.Module):
    """Qwen2-VL-like ViT: ``[N, 1176]`` patch rows -> ``[N / 4, llm_hidden]`` embeddings,
    attention within each image only.

    ``conv_matmul`` picks the patch embedding (Conv3d with kernel = stride = ``(2, 14, 14)``,
    or its matmul equivalent); ``varlen`` picks the attention (varlen over the images'
    ``cu_seqlens``, or one dense block-diagonal mask over all the microbatch's patches).
    The four combinations compute the same function; build them with
    :func:`init_vision_encoder` to get the same weights too."""

    def __init__(self, cfg: ModelConfig, *, conv_matmul: bool, varlen: bool) -> None:
        super().__init__()
        self.patch_embed = nn.Conv3d(CHANNELS, cfg.vit_hidden, KERNEL, stride=KERNEL, bias=False)
        if conv_matmul:
            replace_conv(self, "patch_embed")
        self.blocks = nn.ModuleList(VisionBlock(cfg.vit_hidden, cfg.vit_heads, varlen=varlen)
                                    for _ in range(cfg.vit_layers))
        self.merger = PatchMerger(cfg.vit_hidden, cfg.llm_hidden)
        self.hidden = cfg.vit_hidden

    def set_input_tensor(self, tensors: list) -> None:
        """Schedules call this on every model; the encoder is a first region: nothing comes in."""

    def forward(self, batch: ModelBatch) -> torch.Tensor:
        pixels = batch.pixel_values
        if pixels.shape[0] % (MERGE * MERGE):
            raise ValueError(f"VisionEncoder: {pixels.shape[0]} patch rows are not whole {MERGE}x{MERGE} merge "
                             f"groups (samples {batch.sample_ids})")
        cu_seqlens = image_cu_seqlens(batch.image_grid_thw)
        if int(cu_seqlens[-1]) != pixels.shape[0]:
            raise ValueError(f"VisionEncoder: image_grid_thw covers {int(cu_seqlens[-1])} patches but pixel_values "
                             f"has {pixels.shape[0]} rows (samples {batch.sample_ids})")
        x = self.patch_embed(pixels.view(-1, CHANNELS, *KERNEL)).reshape(pixels.shape[0], self.hidden)
        for block in self.blocks:
            x = block(x, cu_seqlens)
        return self.merger(x)


def init_vision_encoder(cfg: ModelConfig, *, conv_matmul: bool, varlen: bool) -> VisionEncoder:
    """A :class:`VisionEncoder` whose weights depend on ``cfg.seed`` only: the Conv3d and
    matmul patch embeddings hold the same kernel (initialised in the conv layout, then
    flattened), so the baseline and FlowTrain start identical.  ``cfg.freeze_vit``: its
    parameters do not require gradients."""
    encoder = VisionEncoder(cfg, conv_matmul=False, varlen=varlen)
    init_by_name(encoder.named_parameters(prefix="vit"), cfg.seed, INIT_STD)
    if conv_matmul:
        replace_conv(encoder, "patch_embed")
    return encoder.requires_grad_(not cfg.freeze_vit)
