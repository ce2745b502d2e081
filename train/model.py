"""The tiny vision-language model: the one VLM the main job trains and every test of the
runtime, the pool and the schedules runs (``tests/support/tiny_vlm.py`` only adapts its
batches and loss), in both of the layouts the job compares.

- :class:`~.vision.VisionEncoder` (:mod:`.vision`): a Qwen2-VL-like ViT (Conv3d or matmul
  patch embedding, dense or varlen attention within each image, 2x2 merger + projector).
- :func:`~.backbone.build_gpt_stage` / :func:`~.backbone.build_plain_stage` (:mod:`.backbone`):
  one pipeline stage of the text backbone, megatron-core's ``GPTModel`` or the same in plain
  PyTorch, whose weights depend on the seed and each parameter's *global* name only, so every
  pipeline split starts from the same model.
- :class:`StageModule` + :func:`forward_step` (here): what Megatron's 1F1B schedule and the
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

from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from mindspeed_flow.data.conversation import IGNORE

from .backbone import (  # noqa: F401 - the job's names
    build_gpt_stage, build_plain_stage, enable_fused_attn, gpt_config, packed_seq_params)
from .batches import ModelBatch
from .parts import ModelConfig  # noqa: F401 - the job's names (train.config reads it here)
from .vision import VisionEncoder, image_cu_seqlens, init_vision_encoder  # noqa: F401 - the job's names

if TYPE_CHECKING:
    from mindspeed_flow.runtime import LossRules


class StageModule(nn.Module):
    """One rank's part of the VLM, as Megatron's schedules and the plugin's executor run it.

    Stage 0 embeds the tokens and puts the image embeddings at the image token positions:
    from ``vit`` when the stage runs the encoder itself (the baseline: ViT inside stage 0),
    or from its pipeline input (``vit=None``: the decoupled layout sends them).  Later stages
    take the previous stage's hidden states.  The last stage returns the per-token loss
    ``[B, S]`` (0 where the next label is -100); others return hidden states ``[S, B, H]``.

    ``text_only`` (the job's text-only upper bound): no image embeddings at all; every image
    token is embedded by the token embedding like any text token, so the backbone sees the
    same sequences as with images.

    ``gpt`` is either build of :mod:`.backbone`: megatron-core's stage, or the plain one
    (no rotary embedding: its positions are the mask's order).
    """

    def __init__(self, gpt: nn.Module, *, vit: nn.Module | None = None, text_only: bool = False) -> None:
        super().__init__()
        if text_only and vit is not None:
            raise ValueError("StageModule: a text-only stage runs no ViT")
        self.gpt, self.vit, self.text_only = gpt, vit, text_only
        self.config, self.model_type = gpt.config, gpt.model_type  # what Megatron's schedules read
        self.image_token_id = gpt.flow_model_config.image_token_id
        self.image_input: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list) -> None:
        if not self.gpt.pre_process:
            self.gpt.set_input_tensor(tensors)
        elif self.vit is None and not self.text_only:
            self.image_input = tensors[0]

    def forward(self, batch: ModelBatch) -> torch.Tensor:
        gpt = self.gpt
        packed = packed_seq_params(batch) if batch.attention == "varlen" else None
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
        row-major order of the image tokens (the order the loader keeps images in); text
        only: the token embeddings alone."""
        if self.text_only:
            return self.gpt.embedding(input_ids=batch.input_ids, position_ids=batch.position_ids).contiguous()
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

    def _rotary(self, batch: ModelBatch, packed: Any) -> torch.Tensor | None:
        """RoPE frequencies with positions restarting at every sample start: for THD the
        table Megatron applies per segment, for dense rows the table gathered at each
        token's position (``[S, B, 1, D]``)."""
        if not hasattr(self.gpt, "rotary_pos_emb"):
            return None
        if packed is not None:
            return self.gpt.rotary_pos_emb(packed.max_seqlen_q, packed_seq=True)
        table = self.gpt.rotary_pos_emb(int(batch.position_ids.max()) + 1)[:, 0]  # [L, 1, D]
        return table[batch.position_ids.t()]


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
