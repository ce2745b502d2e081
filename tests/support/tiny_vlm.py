"""A tiny VLM for the runtime's tests and benchmark: a plain-PyTorch ViT + projector in
front of a megatron-core ``GPTModel`` stage.

Microbatch ``m`` is ``{"pixels": [patches, patch_dim], "tokens": [1, T], "labels": [1,
patches + T]}``: an image whose embeddings go in front of the text, so the sequence length
is the patch count plus the text length (nothing padded).  ``device_time``, when given,
wraps each module's output (the benchmark's emulated device compute).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

DeviceTime = Callable[[torch.Tensor, dict, str], torch.Tensor]


class ViT(nn.Module):
    """Patch embedding, one tanh layer and a projector to the LLM's hidden size."""

    def __init__(self, hidden: int, patch_dim: int, device_time: DeviceTime | None = None) -> None:
        super().__init__()
        self.patch = nn.Linear(patch_dim, hidden)
        self.layer = nn.Linear(hidden, hidden)
        self.projector = nn.Linear(hidden, hidden)
        self.device_time = device_time

    def set_input_tensor(self, tensors: list) -> None:
        """The first region: nothing comes in."""

    def forward(self, batch: dict) -> torch.Tensor:
        out = self.projector(torch.tanh(self.layer(self.patch(batch["pixels"]))))
        return self.device_time(out, batch, "vit") if self.device_time else out


class TextStage(nn.Module):
    """A GPTModel stage.  Stage 0 puts the image embeddings in front of the token embeddings
    and feeds the decoder through ``decoder_input``; they come from its pipeline input, or
    from ``vit`` when the stage runs the ViT itself (Megatron's layout: ViT in stage 0)."""

    def __init__(self, gpt: nn.Module, first: bool, vit: nn.Module | None = None,
                 device_time: DeviceTime | None = None) -> None:
        super().__init__()
        self.gpt, self.first, self.vit, self.device_time = gpt, first, vit, device_time
        self.config, self.model_type = gpt.config, gpt.model_type  # what Megatron's schedules read
        self.image: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list) -> None:
        if self.first:
            self.image = tensors[0]
        else:
            self.gpt.set_input_tensor(tensors)

    def forward(self, batch: dict) -> torch.Tensor:
        text_length = batch["tokens"].shape[1]
        positions = torch.arange(batch["pixels"].shape[0] + text_length).unsqueeze(0)
        labels = batch["labels"] if self.gpt.post_process else None
        if self.first:
            image = self.vit(batch) if self.vit is not None else self.image
            text = self.gpt.embedding(input_ids=batch["tokens"], position_ids=positions[:, -text_length:])
            out = self.gpt(None, positions, None, decoder_input=torch.cat([image.unsqueeze(1), text]), labels=labels)
        else:
            out = self.gpt(None, positions, None, labels=labels)
        return self.device_time(out, batch, "llm") if self.device_time else out


def text_loss(batch: dict) -> Callable:
    """Megatron's 2-value ``loss_func`` over the text positions of ``batch``."""
    image = batch["pixels"].shape[0]

    def loss_func(output: torch.Tensor):
        loss = output[:, image:].float().mean()
        return loss, {"loss": loss.detach().clone()}

    return loss_func


def forward_step(data_iterator, model: nn.Module):
    """Megatron's ``forward_step_func`` contract."""
    batch = next(data_iterator)
    return model(batch), text_loss(batch)
