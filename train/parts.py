"""What every part of the tiny VLM shares: its shapes and seed (:class:`ModelConfig`) and the
initialisation by parameter name that makes every build of it start from the same weights.

It sits below :mod:`.vision`, :mod:`.backbone` and :mod:`.model` so that each can import it
without importing the others.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterable

import torch

INIT_STD = 0.02  # Megatron's init_method_std default, used for the ViT and the plain backbone too


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and seed of the tiny VLM (the YAML section ``model:``).

    ``vocab_size`` and ``image_token_id`` are 0 / -1 until the job reads them from the
    corpus's tokenizer.  ``freeze_vit``: the ViT is not trained (every run), which lets the
    flow's encoder ranks run ahead into the next step (``layout.flow``)."""

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
    freeze_vit: bool = False  # every run: the ViT's weights stay fixed (no gradients, no optimizer state)


def init_by_name(named: Iterable[tuple[str, torch.Tensor]], seed: int, scaled_std: float,
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
