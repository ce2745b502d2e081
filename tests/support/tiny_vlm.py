"""The tests' adapter over the one tiny VLM (:mod:`mindspeed_flow.train.model`): small shapes,
data items, Megatron's 2-value loss, and the plain-PyTorch pipeline the fast runtime tests run.

Microbatch ``m`` is one sample: an image of ``patches`` merged tokens (``4 * patches`` loader
patch rows) followed by ``text`` text tokens, so the sequence length differs per microbatch
and nothing is padded.  A data item is a dict ``{"batch": ModelBatch, "index": m, "patches":
patches}`` (the executor reads pool metadata such as ``sample_ids`` from dict items, which the
pool tests add); :func:`forward_step` feeds its ``batch`` to the model.

The loss is the mean next-token cross entropy of the text (2-value form: Megatron's schedules
and the executor's default rules divide it by the number of microbatches), unlike the job's
per-token step loss, so the runtime's default loss path is what these tests exercise.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from mindspeed_flow.data.conversation import IGNORE
from mindspeed_flow.data.images import MERGE
from mindspeed_flow.train.batches import ModelBatch
from mindspeed_flow.train.model import ModelConfig, StageModule, build_plain_stage, init_vision_encoder  # noqa: F401 - StageModule: the tests wrap stages in it
from mindspeed_flow.train.vision import PATCH_ROW

VOCAB = 64
IMAGE_TOKEN = VOCAB - 1
# the megatron-backed tests' shapes (the backbone as the tiny GPT harness's: 4 layers of 32)
CONFIG = ModelConfig(vit_hidden=16, vit_layers=1, vit_heads=2, llm_hidden=32, llm_layers=4, llm_heads=4,
                     llm_ffn=64, vocab_size=VOCAB, image_token_id=IMAGE_TOKEN, seed=5)


def vlm_item(m: int, patches: int, text: int, generator: torch.Generator, cfg: ModelConfig = CONFIG) -> dict:
    """Microbatch ``m``: ``patches`` image tokens (a ``1 x 2 x 2*patches`` patch grid), then
    ``text`` random text tokens; labels are the text (the image positions carry none)."""
    tokens = patches + text
    input_ids = torch.cat([torch.full((patches,), cfg.image_token_id),
                           torch.randint(0, cfg.image_token_id, (text,), generator=generator)])[None]
    labels = input_ids.clone()
    labels[:, :patches] = IGNORE
    batch = ModelBatch(
        input_ids=input_ids, labels=labels, position_ids=torch.arange(tokens)[None],
        pixel_values=torch.randn(MERGE * MERGE * patches, PATCH_ROW, generator=generator),
        image_grid_thw=torch.tensor([[1, MERGE, MERGE * patches]]), segments=torch.tensor([0, tokens], dtype=torch.int32),
        attention="dense", loss_tokens=text, sample_ids=[f"mb{m}"], padded_tokens=tokens)
    return {"batch": batch, "index": m, "patches": patches}


def vlm_items(patches: Sequence[int], text: int, seed: int, cfg: ModelConfig = CONFIG) -> list[dict]:
    """One item per entry of ``patches``, from a generator seeded by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [vlm_item(m, p, text, generator, cfg) for m, p in enumerate(patches)]


def vit(cfg: ModelConfig = CONFIG, *, frozen: bool = False) -> nn.Module:
    """The ViT of ``cfg`` (Conv3d patch embedding, dense attention: the baseline's variant)."""
    encoder = init_vision_encoder(cfg, conv_matmul=False, varlen=False)
    encoder.requires_grad_(not frozen)
    return encoder


def text_loss(batch: ModelBatch) -> Callable[[torch.Tensor], tuple]:
    """Megatron's 2-value ``loss_func``: the mean of the last stage's per-token loss over the
    positions that have a next-token target."""
    counted = int((batch.next_token_labels() != IGNORE).sum())

    def loss_func(per_token: torch.Tensor) -> tuple[torch.Tensor, dict]:
        loss = per_token.float().sum() / counted
        return loss, {"loss": loss.detach().clone()}

    return loss_func


def forward_step(data_iterator: Iterator[dict], model: nn.Module) -> tuple[torch.Tensor, Callable]:
    """Megatron's ``forward_step_func`` contract over the items of :func:`vlm_items`."""
    batch = next(data_iterator)["batch"]
    return model(batch), text_loss(batch)


def gpt_stage(layers: list[int], stage: int, state: dict | None = None, cfg: ModelConfig = CONFIG) -> nn.Module:
    """Stage ``stage`` of megatron-core's backbone split as ``layers`` (dense masks), inside
    Megatron's parallel state; with ``state`` (global names, the whole model's), loaded from
    its slice strictly, so the stage provably holds the reference's weights."""
    from mindspeed_flow.adapters.megatron.global_names import stage_state_dict
    from mindspeed_flow.train.model import build_gpt_stage

    gpt = build_gpt_stage(cfg, layers, stage, packed=False)
    if state is not None:
        gpt.load_state_dict(stage_state_dict(state, gpt), strict=True)
    return gpt


def microbatch_index(batch: ModelBatch) -> int:
    """``m`` of a batch made by :func:`vlm_item` (its sample id is ``mb<m>``)."""
    return int(batch.sample_ids[0][2:])


# --------------------------------------------------------------------------- plain PyTorch pipeline

PATCHES = (3, 5, 2, 4, 6, 1)  # per microbatch: encoder output rows (no padding anywhere)
TOKENS = 4
PLAIN = replace(CONFIG, vit_hidden=8, vit_heads=2, llm_hidden=8, llm_layers=2, llm_heads=2, llm_ffn=16,
                vocab_size=16, image_token_id=15, seed=3)
SPLIT = [1, 1]


def make_batches(count: int, seed: int = 7) -> list[dict]:
    """Items for :func:`build`'s pipeline: microbatch ``m`` has ``PATCHES[m % 6]`` image tokens."""
    return vlm_items([PATCHES[m % len(PATCHES)] for m in range(count)], TOKENS, seed, PLAIN)


def build(seed: int = 3, frozen_encoder: bool = False) -> dict[str, nn.Module]:
    """The VLM with the plain backbone, no megatron-core: ``vit`` (a region of its own),
    ``llm0`` / ``llm1`` (the backbone's two stages; ``llm0`` takes the image embeddings as
    its pipeline input)."""
    cfg = replace(PLAIN, seed=seed)
    parts: dict[str, nn.Module] = {"vit": vit(cfg, frozen=frozen_encoder)}
    for stage in range(len(SPLIT)):
        parts[f"llm{stage}"] = StageModule(build_plain_stage(cfg, SPLIT, stage))
    return parts


def reference(parts: dict[str, nn.Module], batches: list[dict]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The whole model in one process, microbatch after microbatch, loss / count (Megatron's
    no-pipelining arithmetic); returns losses and every gradient by ``part.param``."""
    count = len(batches)
    losses = []
    for item in batches:
        batch = item["batch"]
        hidden: Any = parts["vit"](batch)
        for stage in range(len(SPLIT)):
            parts[f"llm{stage}"].set_input_tensor([hidden])
            hidden = parts[f"llm{stage}"](batch)
        loss, reduced = text_loss(batch)(hidden)
        (loss / count).backward()
        losses.append(float(reduced["loss"]))
    return losses, grads_of(parts)


def grads_of(parts: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    return {f"{name}.{p_name}": p.grad.clone() for name, part in parts.items()
            for p_name, p in part.named_parameters() if p.grad is not None}
