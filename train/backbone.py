"""The tiny VLM's text backbone, one pipeline stage at a time, in two builds:

- :func:`build_gpt_stage`: a stage of megatron-core's ``GPTModel`` (RoPE, fp32, no dropout,
  untied embeddings), what the job trains and the Megatron-backed tests run;
- :func:`build_plain_stage`: :class:`PlainGPTStage`, the same kind of stage in plain PyTorch
  with the few ``GPTModel`` members :class:`~.model.StageModule` uses, so the runtime's fast
  tests run the same VLM without megatron-core.

Both name their layers ``decoder.layers.<i>`` with Megatron's ``layer_number`` and initialise
every weight from the seed and its *global* name, so every pipeline split of either starts
from the same model.  megatron-core is imported inside functions only.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mindspeed_flow.adapters.megatron.global_names import global_name, layer_offset

from .parts import INIT_STD, ModelConfig, init_by_name

MAX_SEQUENCE_LENGTH = 1 << 15  # GPTModel wants one; RoPE builds its table per call
SCALED = ("linear_proj.weight", "linear_fc2.weight")  # Megatron's output-layer init rule
FUSED_ATTN = "fused_attn"  # the plugin's feature that serves THD batches in megatron-core's attention


def _init_stage(stage: nn.Module, cfg: ModelConfig, layers: list[int]) -> None:
    """Weights from ``cfg.seed`` and each parameter's global name (both builds)."""
    offset = layer_offset(stage)
    init_by_name(((global_name(n, offset), p) for n, p in stage.named_parameters()), cfg.seed,
                 INIT_STD / math.sqrt(2.0 * sum(layers)), scaled=SCALED)


# --------------------------------------------------------------------------- megatron-core GPT


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
    _init_stage(gpt, cfg, layers)
    gpt.flow_model_config = cfg
    return gpt


def packed_seq_params(batch: ModelBatch) -> Any:
    """Megatron's THD description of a varlen batch's segments."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int(batch.segments.diff().max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=batch.segments, cu_seqlens_kv=batch.segments,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def enable_fused_attn() -> Any:
    """Turn on the ``fused_attn`` patch of megatron-core's attention (varlen for packed THD
    batches, what a ``packed`` stage needs) unless the plugin's registry already has it on;
    returns the registry to remove when the run closes (``None`` when it was already on)."""
    from mindspeed_flow.activation import current_registry
    from mindspeed_flow.patches import fused_attn
    from mindspeed_flow.patching import PatchRegistry

    active = current_registry()
    if active is not None and FUSED_ATTN in active.enabled:
        return None
    registry = PatchRegistry([p for p in fused_attn.PATCHES if p.module.startswith("megatron.")])
    registry.enable({FUSED_ATTN})
    return registry


# --------------------------------------------------------------------------- plain PyTorch


class PlainEmbedding(nn.Module):
    """Token embeddings ``[S, B, H]`` (Megatron's layout); positions are left to the mask."""

    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, hidden)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(input_ids).transpose(0, 1)


class PlainLayer(nn.Module):
    """Pre-norm block: causal multi-head attention under Megatron's dense mask, GELU MLP;
    Megatron's member names, so the same init rule and global names apply."""

    def __init__(self, cfg: ModelConfig, layer_number: int) -> None:
        super().__init__()
        hidden = cfg.llm_hidden
        if hidden % cfg.llm_heads:
            raise ValueError(f"llm_hidden {hidden} is not a multiple of llm_heads {cfg.llm_heads}")
        self.layer_number, self.heads = layer_number, cfg.llm_heads
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = nn.ModuleDict({"linear_qkv": nn.Linear(hidden, 3 * hidden),
                                             "linear_proj": nn.Linear(hidden, hidden)})
        self.pre_mlp_layernorm = nn.LayerNorm(hidden)
        self.mlp = nn.ModuleDict({"linear_fc1": nn.Linear(hidden, cfg.llm_ffn),
                                  "linear_fc2": nn.Linear(cfg.llm_ffn, hidden)})

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``x`` ``[S, B, H]``; ``mask`` ``[B, 1, S, S]``, True = masked out."""
        seq, rows, hidden = x.shape
        attention = self.self_attention
        q, k, v = attention["linear_qkv"](self.input_layernorm(x)).view(
            seq, rows, 3, self.heads, hidden // self.heads).unbind(2)
        scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(q.shape[-1])
        # a padding query sees no key: the finite minimum keeps its (unused) row finite
        weights = scores.masked_fill(mask, torch.finfo(scores.dtype).min).softmax(dim=-1)
        x = x + attention["linear_proj"](torch.einsum("bhqk,kbhd->qbhd", weights, v).reshape(seq, rows, hidden))
        mlp = self.mlp
        return x + mlp["linear_fc2"](F.gelu(mlp["linear_fc1"](self.pre_mlp_layernorm(x))))


class PlainDecoder(nn.Module):
    """The stage's layers; a later stage starts from its pipeline input, as Megatron's
    ``TransformerBlock`` does, and the last one ends with the final norm."""

    def __init__(self, cfg: ModelConfig, first_layer: int, count: int, *, last: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(PlainLayer(cfg, first_layer + i + 1) for i in range(count))
        self.final_layernorm = nn.LayerNorm(cfg.llm_hidden) if last else None
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list) -> None:
        self.input_tensor = tensors[0]

    def forward(self, hidden_states: torch.Tensor | None, attention_mask: torch.Tensor | None,
                rotary_pos_emb: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        if packed_seq_params is not None or attention_mask is None:
            raise ValueError("PlainDecoder: dense attention only (a ModelBatch with attention='dense')")
        x = self.input_tensor if hidden_states is None else hidden_states
        for layer in self.layers:
            x = layer(x, attention_mask)
        return self.final_layernorm(x) if self.final_layernorm is not None else x


class PlainOutputLayer(nn.Linear):
    """Megatron's ``(logits, bias)`` output-layer convention."""

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return super().forward(hidden), None


class PlainGPTStage(nn.Module):
    """One pipeline stage of a GPT in plain PyTorch: the members of megatron-core's
    ``GPTModel`` that :class:`~.model.StageModule` reads (``pre_process``, ``post_process``,
    ``embedding``, ``decoder``, ``output_layer``, ``compute_language_model_loss``,
    ``set_input_tensor``, ``config``, ``model_type``), no rotary embedding (dense masks only)."""

    config = None  # no TransformerConfig: Megatron's schedules do not run this build
    model_type = None

    def __init__(self, cfg: ModelConfig, layers: list[int], stage: int) -> None:
        super().__init__()
        self.pre_process, self.post_process = stage == 0, stage == len(layers) - 1
        self.embedding = PlainEmbedding(cfg.vocab_size, cfg.llm_hidden) if self.pre_process else None
        self.decoder = PlainDecoder(cfg, sum(layers[:stage]), layers[stage], last=self.post_process)
        self.output_layer = PlainOutputLayer(cfg.llm_hidden, cfg.vocab_size, bias=False) if self.post_process else None
        self.flow_model_config = cfg

    def set_input_tensor(self, tensors: list) -> None:
        self.decoder.set_input_tensor(tensors)

    @staticmethod
    def compute_language_model_loss(labels: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """``[B, S]`` cross entropy of ``logits`` ``[S, B, V]`` (Megatron's signature)."""
        return F.cross_entropy(logits.transpose(0, 1).flatten(0, 1).float(), labels.flatten(),
                               reduction="none").view_as(labels)


def build_plain_stage(cfg: ModelConfig, layers: list[int], stage: int) -> PlainGPTStage:
    """Stage ``stage`` of the plain backbone split as ``layers``; no parallel state needed.
    Weights depend on ``cfg.seed`` and global names only, as :func:`build_gpt_stage`'s."""
    if cfg.vocab_size < 1:
        raise ValueError(f"ModelConfig.vocab_size is {cfg.vocab_size}: set it first")
    if not 0 <= stage < len(layers) or any(n < 1 for n in layers):
        raise ValueError(f"build_plain_stage: stage {stage} of the split {layers}")
    module = PlainGPTStage(cfg, layers, stage)
    _init_stage(module, cfg, layers)
    return module
