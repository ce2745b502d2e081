"""Tiny plain-PyTorch pipelines for the runtime's tests: a ViT-like encoder whose output
length varies per microbatch (its patch count), and a two-stage text model.

Each module takes its pipeline input through ``set_input_tensor`` like Megatron's models;
``forward_step`` has Megatron's ``forward_step_func`` signature, so the same function runs a
rank's chunk in the runtime and the whole model in the single-process reference.
"""

from __future__ import annotations

import torch
from torch import nn

DIM = 8
PATCHES = (3, 5, 2, 4, 6, 1)  # per microbatch: encoder output rows (no padding anywhere)
TOKENS = 4


class Encoder(nn.Module):
    """Patches -> embeddings (ViT + projector stand-in); the first region: no input tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.vit = nn.Linear(DIM, DIM)
        self.projector = nn.Linear(DIM, DIM)

    def set_input_tensor(self, tensors: list) -> None:
        assert tensors == [None], "the encoder is the first region"

    def forward(self, batch: dict) -> torch.Tensor:
        return self.projector(torch.tanh(self.vit(batch["pixels"])))


class TextStage(nn.Module):
    """One pipeline stage of the text model; the first one prepends the image embeddings
    (its input tensor) to the token embeddings, the last one reduces to a loss."""

    def __init__(self, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        self.embed = nn.Embedding(16, DIM) if first else None
        self.layer = nn.Linear(DIM, DIM)
        self.input: torch.Tensor | None = None

    def set_input_tensor(self, tensors: list) -> None:
        self.input = tensors[0]

    def forward(self, batch: dict) -> torch.Tensor:
        h = torch.cat([self.input, self.embed(batch["tokens"])]) if self.first else self.input
        return torch.tanh(self.layer(h))


def make_batches(count: int, seed: int = 7) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"pixels": torch.randn(PATCHES[m % len(PATCHES)], DIM, generator=g),
             "tokens": torch.randint(0, 16, (TOKENS,), generator=g), "index": m} for m in range(count)]


def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = output.pow(2).mean()
    return loss, {"loss": loss.detach().clone()}


def forward_step(data_iterator, model: nn.Module):
    """Megatron's ``forward_step_func`` contract: (output, loss_func)."""
    return model(next(data_iterator)), loss_func


def build(seed: int = 3, frozen_encoder: bool = False) -> dict[str, nn.Module]:
    torch.manual_seed(seed)
    parts = {"vit": Encoder(), "llm0": TextStage(True, False), "llm1": TextStage(False, True)}
    if frozen_encoder:
        parts["vit"].requires_grad_(False)
    return parts


def reference(parts: dict[str, nn.Module], batches: list[dict]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The whole model in one process, microbatch after microbatch, loss / count (Megatron's
    no-pipelining arithmetic); returns losses and every gradient by ``part.param``."""
    count = len(batches)
    losses = []
    for batch in batches:
        parts["vit"].set_input_tensor([None])
        h = parts["vit"](batch)
        parts["llm0"].set_input_tensor([h])
        h = parts["llm0"](batch)
        parts["llm1"].set_input_tensor([h])
        loss, reduced = loss_func(parts["llm1"](batch))
        (loss / count).backward()
        losses.append(float(reduced["loss"]))
    return losses, grads_of(parts)


def grads_of(parts: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    return {f"{name}.{p_name}": p.grad.clone() for name, part in parts.items()
            for p_name, p in part.named_parameters() if p.grad is not None}
