"""The tiny vision-language model the main job trains: a Qwen2-VL-like ViT and a megatron-core
GPT backbone, in both of the layouts the job compares.

- :class:`VisionEncoder`: patch embedding of the loader's ``[N, 1176]`` rows (Conv3d as
  upstream, or :class:`~mindspeed_flow.attention.patch_embed.PatchEmbedMatmul`), pre-norm
  blocks whose attention stays inside each image (one dense block-diagonal mask, or varlen
  attention over the images' ``cu_seqlens``), and Qwen2-VL's 2x2 merger + projector.
- :func:`build_gpt_stage`: one pipeline stage of a megatron-core ``GPTModel`` (RoPE, fp32, no
  dropout, untied embeddings) whose weights depend on the seed and each parameter's *global*
  name only, so every pipeline split starts from the same model.
- :class:`StageModule` + :func:`forward_step`: what Megatron's 1F1B schedule and the
  plugin's executor run on one rank, with the step loss convention of the main job.

Dense and varlen compute the same numbers on the same samples: attention is restricted to
each sample (image) either way, and positions restart at every sample start in both (RoPE is
applied per sample), which is what the job's parity mode checks step by step.

Loss convention: the step loss is ``sum(CE over every position whose next label is not
-100) / loss_tokens`` over the whole step (all microbatches, all replicas).  Each
microbatch's ``loss_func`` returns its share ``sum / loss_tokens`` as Megatron's 3-value
form, and the GPT config sets ``calculate_per_token_loss=True``, under which Megatron's
schedules (0.12 and 0.16) neither divide by the token count nor by the number of
microbatches: the backward of each share sums to the gradient of the step loss on a
replica, and summing (not averaging) gradients over data-parallel replicas gives exactly the
step loss's gradient.  The plugin's executor follows the same rule when it is given
``LossRules(calculate_per_token_loss=True)`` (:func:`loss_rules`).

megatron-core is imported inside functions only (``mindspeed-flow --help`` needs none).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mindspeed_flow.adapters.megatron.global_names import global_name, layer_offset
from mindspeed_flow.attention.patch_embed import replace_conv
from mindspeed_flow.attention.varlen import varlen_attention
from mindspeed_flow.data.conversation import IGNORE
from mindspeed_flow.data.images import MERGE, PATCH, TEMPORAL_PATCH

from .batches import ModelBatch

if TYPE_CHECKING:
    from mindspeed_flow.runtime import LossRules

CHANNELS = 3
KERNEL = (TEMPORAL_PATCH, PATCH, PATCH)  # one row of the loader = one Conv3d window
INIT_STD = 0.02  # Megatron's init_method_std default, used for the ViT too
MAX_SEQUENCE_LENGTH = 1 << 15  # GPTModel wants one; RoPE builds its table per call


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and seed of the tiny VLM (the YAML section ``model:``).

    ``vocab_size`` and ``image_token_id`` are 0 / -1 until the job reads them from the
    corpus's tokenizer."""

    vit_hidden: int = 64
    vit_layers: int = 2
    vit_heads: int = 4
    llm_hidden: int = 64
    llm_layers: int = 4
    llm_heads: int = 4
    llm_ffn: int = 128
    vocab_size: int = 0
    image_token_id: int = -1
    seed: int = 1234


# --------------------------------------------------------------------------- initialisation


def _init_by_name(named: Iterable[tuple[str, torch.Tensor]], seed: int, scaled_std: float,
                  scaled: tuple[str, ...] = ()) -> None:
    """Initialise each parameter from a generator seeded by ``seed`` and its name alone.

    Why by name: a parameter then gets the same values whichever module (pipeline stage,
    Conv3d or matmul patch embedding) holds it and in whatever order they are built, so a
    2-stage split starts from exactly the 1-stage model.  Norm weights are 1, biases 0,
    other weights normal(0, 0.02) (``scaled_std`` for names ending in ``scaled``, Megatron's
    output-layer rule)."""
    with torch.no_grad():
        for name, param in named:
            if name.endswith("bias"):
                param.zero_()
            elif "norm" in name:
                param.fill_(1.0)
            else:
                generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                std = scaled_std if name.endswith(scaled) else INIT_STD
                param.copy_(torch.empty(param.shape).normal_(0.0, std, generator=generator))


# --------------------------------------------------------------------------- vision encoder


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
    flattened), so the baseline and FlowTrain start identical."""
    encoder = VisionEncoder(cfg, conv_matmul=False, varlen=varlen)
    _init_by_name(encoder.named_parameters(prefix="vit"), cfg.seed, INIT_STD)
    if conv_matmul:
        replace_conv(encoder, "patch_embed")
    return encoder


# --------------------------------------------------------------------------- GPT backbone


def _split_fields(layers: list[int]) -> dict[str, int]:
    """Megatron's fields for the split ``layers``: uniform splits need none; otherwise the
    first (and, past 2 stages, last) stage is given, and the middle ones must be equal."""
    if any(n < 1 for n in layers):
        raise ValueError(f"every pipeline stage needs at least one LLM layer, got the split {layers}")
    if len(set(layers)) == 1:
        return {}
    if len(layers) == 2:
        return {"num_layers_in_first_pipeline_stage": layers[0]}
    if len(set(layers[1:-1])) != 1:
        raise ValueError(f"split {layers}: megatron-core needs the middle stages to hold equal layer counts")
    return {"num_layers_in_first_pipeline_stage": layers[0], "num_layers_in_last_pipeline_stage": layers[-1]}


def gpt_config(cfg: ModelConfig, layers: list[int]) -> Any:
    """The ``TransformerConfig`` of the backbone split as ``layers``: fp32, no dropout,
    CPU-safe (unfused) kernels everywhere so every device computes the reference math,
    variable sequence lengths between pipeline stages, and the per-token loss rule of the
    module docstring."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mindspeed_flow.adapters.megatron.core import cpu_safe_config_overrides

    return TransformerConfig(
        num_layers=sum(layers), hidden_size=cfg.llm_hidden, num_attention_heads=cfg.llm_heads,
        ffn_hidden_size=cfg.llm_ffn, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, pipeline_model_parallel_size=len(layers),
        variable_seq_lengths=True, calculate_per_token_loss=True,
        moe_token_dispatcher_type="alltoall",  # no MoE here; the default one refuses variable lengths
        **_split_fields(layers), **cpu_safe_config_overrides(),
    )


def _layer_spec(packed: bool) -> Any:
    """Megatron's local GPT layer; for dense attention the mask type is ``arbitrary`` so the
    explicit mask (causal, same sample, not padding) is what every softmax path applies
    (a ``causal`` type would let a fused kernel replace it by the plain causal mask)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    spec = get_gpt_layer_local_spec()
    if packed:
        return spec
    attention = spec.submodules.self_attention
    attention = replace(attention, params={**attention.params, "attn_mask_type": AttnMaskType.arbitrary})
    return replace(spec, submodules=replace(spec.submodules, self_attention=attention))


def build_gpt_stage(cfg: ModelConfig, layers: list[int], stage: int, *, packed: bool) -> Any:
    """Pipeline stage ``stage`` of the backbone split as ``layers`` (LLM layers per stage).

    Megatron's parallel state must be initialised with ``len(layers)`` pipeline stages and
    this rank at ``stage``.  ``packed`` builds the layers for THD batches (causal mask type,
    served by the ``fused_attn`` patch) instead of explicit dense masks; the parameters are
    the same either way.  Weights depend on ``cfg.seed`` and global names only.  The
    stage's :class:`ModelConfig` is kept as ``flow_model_config`` (:class:`StageModule` reads
    the image token id from it)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if cfg.vocab_size < 1:
        raise ValueError(f"ModelConfig.vocab_size is {cfg.vocab_size}: set it from the tokenizer first")
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if (pp_size, pp_rank) != (len(layers), stage):
        raise ValueError(f"build_gpt_stage: stage {stage} of the split {layers}, but Megatron's parallel state has "
                         f"pipeline rank {pp_rank} of {pp_size}")
    gpt = GPTModel(
        config=gpt_config(cfg, layers), transformer_layer_spec=_layer_spec(packed), vocab_size=cfg.vocab_size,
        max_sequence_length=MAX_SEQUENCE_LENGTH, pre_process=stage == 0, post_process=stage == len(layers) - 1,
        share_embeddings_and_output_weights=False, position_embedding_type="rope",
    )
    offset = layer_offset(gpt)
    _init_by_name(((global_name(n, offset), p) for n, p in gpt.named_parameters()), cfg.seed,
                  INIT_STD / math.sqrt(2.0 * sum(layers)), scaled=("linear_proj.weight", "linear_fc2.weight"))
    gpt.flow_model_config = cfg
    return gpt


# --------------------------------------------------------------------------- one rank's stage


class StageModule(nn.Module):
    """One rank's part of the VLM, as Megatron's schedules and the plugin's executor run it.

    Stage 0 embeds the tokens and puts the image embeddings at the image token positions:
    from ``vit`` when the stage runs the encoder itself (the baseline: ViT inside stage 0),
    or from its pipeline input (``vit=None``: the decoupled layout sends them).  Later stages
    take the previous stage's hidden states.  The last stage returns the per-token loss
    ``[B, S]`` (0 where the next label is -100); others return hidden states ``[S, B, H]``.
    """

    def __init__(self, gpt: nn.Module, *, vit: VisionEncoder | None = None) -> None:
        super().__init__()
        self.gpt, self.vit = gpt, vit
        self.config, self.model_type = gpt.config, gpt.model_type  # what Megatron's schedules read
        self.image_token_id = gpt.flow_model_config.image_token_id
        self.image_input: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list) -> None:
        if not self.gpt.pre_process:
            self.gpt.set_input_tensor(tensors)
        elif self.vit is None:
            self.image_input = tensors[0]

    def forward(self, batch: ModelBatch) -> torch.Tensor:
        gpt = self.gpt
        packed = _packed_seq_params(batch) if batch.attention == "varlen" else None
        hidden = gpt.decoder(
            hidden_states=self._embed(batch) if gpt.pre_process else None,
            attention_mask=None if packed is not None else batch.dense_mask(),
            rotary_pos_emb=self._rotary(batch, packed), packed_seq_params=packed,
        )
        if not gpt.post_process:
            return hidden
        logits, _ = gpt.output_layer(hidden)
        targets = batch.next_token_labels()
        counted = targets != IGNORE
        return gpt.compute_language_model_loss(targets.masked_fill(~counted, 0), logits) * counted

    def _embed(self, batch: ModelBatch) -> torch.Tensor:
        """``[S, B, H]`` token embeddings with the image embeddings scattered in, in the
        row-major order of the image tokens (the order the loader keeps images in)."""
        image = self.vit(batch) if self.vit is not None else self.image_input
        is_image = batch.input_ids == self.image_token_id
        wanted = int(is_image.sum())
        found = 0 if image is None else image.shape[0]
        if found != wanted:
            raise ValueError(f"StageModule: {wanted} image tokens (id {self.image_token_id}) but {found} image "
                             f"embeddings (samples {batch.sample_ids})")
        text = self.gpt.embedding(input_ids=batch.input_ids, position_ids=batch.position_ids).transpose(0, 1)
        if image is not None:  # also with no image token: a pool input of 0 embeddings gets its (empty) gradient
            text = text.masked_scatter(is_image.unsqueeze(-1), image.to(text.dtype))
        return text.transpose(0, 1).contiguous()

    def _rotary(self, batch: ModelBatch, packed: Any) -> torch.Tensor:
        """RoPE frequencies with positions restarting at every sample start: for THD the
        table Megatron applies per segment, for dense rows the table gathered at each
        token's position (``[S, B, 1, D]``)."""
        if packed is not None:
            return self.gpt.rotary_pos_emb(packed.max_seqlen_q, packed_seq=True)
        table = self.gpt.rotary_pos_emb(int(batch.position_ids.max()) + 1)[:, 0]  # [L, 1, D]
        return table[batch.position_ids.t()]


def _packed_seq_params(batch: ModelBatch) -> Any:
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int(batch.segments.diff().max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch.segments, cu_seqlens_kv=batch.segments,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def loss_rules() -> "LossRules":
    """The executor's loss rules that match :func:`forward_step` (see the module docstring)."""
    from mindspeed_flow.runtime import LossRules

    return LossRules(calculate_per_token_loss=True)


def _step_loss(batch: ModelBatch) -> Callable[[torch.Tensor], tuple]:
    """Megatron's 3-value ``loss_func`` for ``batch``: this microbatch's share of the step
    loss, its loss-token count, and ``{"loss": share, "tokens": count}`` for reporting (sum
    the shares over microbatches and replicas to get the step loss)."""

    def loss_func(per_token: torch.Tensor) -> tuple:
        if per_token.shape != batch.labels.shape:
            raise ValueError(f"loss_func: expected the last stage's per-token loss {tuple(batch.labels.shape)}, got "
                             f"{tuple(per_token.shape)} (samples {batch.sample_ids})")
        share = per_token.sum() / batch.loss_tokens
        tokens = (batch.next_token_labels() != IGNORE).sum()
        return share, tokens, {"loss": share.detach().clone(), "tokens": tokens}

    return loss_func


def forward_step(data_iterator: Iterator[ModelBatch], model: nn.Module) -> tuple[torch.Tensor, Callable]:
    """Megatron's ``forward_step_func``: the next :class:`ModelBatch` through ``model`` (a
    :class:`StageModule` or a :class:`VisionEncoder` region) with the step-loss function."""
    batch = next(data_iterator)
    return model(batch), _step_loss(batch)
