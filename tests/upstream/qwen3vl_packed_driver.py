"""MindSpeed-MM's real Qwen3-VL of ``pretrain_transformers.py``, one forward and backward per
batch on CPU in fp32: one pack of the plugin's loader, then the same samples one by one.

Run by ``test_qwen3vl_packed.py`` (beside it) in a subprocess, never imported by pytest:
``python qwen3vl_packed_driver.py CONFIG.yaml`` in a folder holding
``mindspeed_mm/configs/read_yaml_config.py`` (as ``realjob_transformers`` lays a run out).
What runs is the entry script's own code: importing ``pretrain_transformers`` runs its YAML
reader (the command line rebuilt from the YAML) and MindSpeed's adaptor; Megatron is
initialised as ``mindspeed_mm.training.pretrain`` does it; the model is the script's
``model_provider()`` (``TransformersModel`` over ``mindspeed_mm``'s registered
``Qwen3VLForConditionalGeneration``, loaded from the HF directory in fp32); each batch goes
through the script's ``forward_step`` (``move_to_device``, the model's own loss).  Megatron's
DDP wrapper is left out: gradients are the parameters' ``.grad``.

The batches (:func:`plugin_batches`) are made here, in the job's environment (the processor
needs the job's import-only torchvision stand-in): the plugin's ``FlowDataLoader`` reads the
corpus ``QWEN3VL_PACKED_CORPUS`` with the processor in ``QWEN3VL_PACKED_PROCESSOR`` into one
pack, and each sample alone into a pack of its own; the plugin's batch adapter turns a pack into
this model's batch.  ``"packed"``: the pack's batch; ``"one_by_one"``: each sample's, as
upstream's unpacked path gives it (no ``seqlens`` / ``indices``); ``"packed_as_one"`` (the
control): the pack's tokens without ``seqlens`` / ``indices``, one sequence to the model;
``"text_only_packed"`` / ``"text_only_one_by_one"``: the text-only records
``QWEN3VL_PACKED_TEXT_ONLY`` (comma-separated indexes) in one pack with the fake image, and
each alone without it.
Each group is one backward of the summed per-token loss (``loss * loss tokens`` per batch:
the model's default loss is the mean over the batch's loss tokens).
Writes to ``QWEN3VL_PACKED_OUT``: the pack's batch and sample order, and per group: the summed
loss, the loss tokens, every trainable parameter's gradient, the ``npu_fusion_attention``
calls (layout, ``actual_seq_qlen``), the DeepStack injections and every op output whose last
two dimensions both span a batch's LLM tokens or ViT patches (a dense ``[.., S, S]`` mask or
score matrix); and the model's DeepStack layer indexes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class SquareTensors(TorchDispatchMode):
    """Records ``(op, shape)`` of every op output whose last two dims are both one of ``sizes``."""

    def __init__(self, sizes: set[int]) -> None:
        super().__init__()
        self.sizes = sizes
        self.seen: list[tuple[str, list[int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(item, torch.Tensor) and item.dim() >= 2 and item.shape[-1] == item.shape[-2] \
                    and item.shape[-1] in self.sizes:
                self.seen.append((str(func), list(item.shape)))
        return out


CAPACITY = 1024  # the test's samples fit one pack


def flow_loader(corpus: Path, processor_dir: str, records=None):
    """The plugin's loader over ``corpus`` (``records``: the records it reads, in file order)."""
    from mindspeed_flow.adapters.mindspeed_mm.data import load_processor
    from mindspeed_flow.data import FlowDataLoader

    return FlowDataLoader(corpus, load_processor(processor_dir), capacity=CAPACITY, num_workers=0,
                          shuffle=False, window=8, image_root=corpus.parent, records=records,
                          template="qwen3_vl_nothink")  # the Qwen3-VL recipes' chat template


def loader_packs(corpus: Path, processor_dir: str, records=None) -> list[dict]:
    """Every pack of one epoch of the plugin's loader over ``corpus``, in file order."""
    return list(flow_loader(corpus, processor_dir, records))


def model_batch(pack: dict, fake=None) -> dict:
    """The plugin's batch adapter: one pack -> the batch this path's Qwen3-VL reads (``fake``:
    the fake image an image-less pack gets)."""
    from mindspeed_flow.adapters.mindspeed_mm.transformers_batch import transformers_model_batch

    return transformers_model_batch(pack, fake)


def text_only_batches(corpus: Path, processor_dir: str, records: list[int]) -> tuple[dict, dict]:
    """``({"text_only_packed": [batch], "text_only_one_by_one": [...]}, {"text_only_batch": batch})``:
    the text-only ``records`` in one pack with the job's fake image (as the plugin's job adapter
    gives it, :func:`~mindspeed_flow.adapters.mindspeed_mm.transformers_batch.fake_image` of the
    loader's geometry and token ids), and each alone without it (the model skips its ViT)."""
    from mindspeed_flow.adapters.mindspeed_mm.transformers_batch import fake_image

    loader = flow_loader(corpus, processor_dir, records)
    [pack] = list(loader)
    packed = model_batch(pack, fake_image(loader.geometry, loader.special))
    singles = [unpacked(model_batch(loader_packs(corpus, processor_dir, records=[index])[0])) for index in records]
    return {"text_only_packed": [packed], "text_only_one_by_one": singles}, {"text_only_batch": packed}


UNPACKED_KEYS = ("input_ids", "attention_mask", "labels", "pixel_values", "image_grid_thw")


def unpacked(batch: dict) -> dict:
    """A batch as upstream's unpacked path gives it: no ``seqlens`` / ``indices``."""
    return {key: batch[key] for key in UNPACKED_KEYS if key in batch}


def plugin_batches(corpus: Path, processor_dir: str) -> tuple[dict, dict]:
    """``({"packed": [batch], "one_by_one": [batch, ...]}, facts)``: the samples one by one in
    the pack's order; ``facts``: the pack's batch and which record each of its samples is."""
    [pack] = loader_packs(corpus, processor_dir)
    count = len(pack["sample_ids"])
    singles = [loader_packs(corpus, processor_dir, records=[index])[0] for index in range(count)]
    ids = [single["sample_ids"] for single in singles]
    order = [ids.index([sample_id]) for sample_id in pack["sample_ids"]]
    packed = model_batch(pack)
    groups = {"packed": [packed], "one_by_one": [unpacked(model_batch(singles[i])) for i in order],
              "packed_as_one": [unpacked(packed)]}
    return groups, {"batch": packed, "order": order}


def build_model(entry):
    """Megatron initialised as ``mindspeed_mm.training.pretrain`` does, then the script's model."""
    from megatron.training import get_args
    from megatron.training.initialize import initialize_megatron
    from mindspeed_mm.arguments import extra_args_provider_decorator
    from mindspeed_mm.configs.config import merge_mm_args, mm_extra_args_provider
    from mindspeed_mm.patchs.patch_manager import PatchesManager

    initialize_megatron(extra_args_provider=extra_args_provider_decorator(mm_extra_args_provider),
                        args_defaults={"dataloader_type": "external"})
    merge_mm_args(get_args())
    PatchesManager.apply_patches_from_config()
    return entry.model_provider()


def observe(model) -> dict[str, list]:
    """Records the attention kernel's calls and the DeepStack injections into the returned lists."""
    from mindspeed_mm.models.transformers import attention_utils

    seen: dict[str, list] = {"kernel": [], "deepstack": []}
    kernel = attention_utils.npu_fusion_attention

    def npu_fusion_attention(*args, **kwargs):
        seq = kwargs.get("actual_seq_qlen")
        seen["kernel"].append({"layout": kwargs.get("input_layout"), "tokens": int(args[0].shape[0]),
                               "actual_seq_qlen": None if seq is None else [int(x) for x in seq]})
        return kernel(*args, **kwargs)

    attention_utils.npu_fusion_attention = npu_fusion_attention
    text = model.model.model.language_model
    inject = text._deepstack_process

    def deepstack(hidden_states, visual_pos_masks, visual_embeds):
        seen["deepstack"].append({"positions": int(visual_pos_masks.sum()), "rows": int(visual_embeds.shape[0])})
        return inject(hidden_states, visual_pos_masks, visual_embeds)

    text._deepstack_process = deepstack
    return seen


def run_group(entry, model, batches: list[dict], seen: dict[str, list]) -> dict:
    """One backward of the group's summed per-token loss; what it computed and called."""
    model.zero_grad(set_to_none=True)
    for records in seen.values():
        records.clear()
    loss_sum, loss_tokens, square = 0.0, 0, []
    iterator = iter(batches)
    for batch in batches:
        pixels = batch.get("pixel_values")
        sizes = {int(batch["input_ids"].shape[-1])}
        if isinstance(pixels, torch.Tensor):
            sizes.add(int(pixels.shape[0]))
        with SquareTensors(sizes) as recorder:
            output, _ = entry.forward_step(iterator, model)
            count = output["loss_mask"].sum()
            (output["loss"] * count).backward()
        square += recorder.seen
        loss_sum += float(output["loss"].detach().double() * count)
        loss_tokens += int(count)
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for name, p in model.named_parameters() if p.requires_grad}
    return {"loss_sum": loss_sum, "loss_tokens": loss_tokens, "grads": grads, "square": square,
            "kernel": list(seen["kernel"]), "deepstack": list(seen["deepstack"])}


def main() -> None:
    import pretrain_transformers as entry  # noqa: E402  (its YAML reader and MindSpeed's adaptor run here)

    corpus, processor = Path(os.environ["QWEN3VL_PACKED_CORPUS"]), os.environ["QWEN3VL_PACKED_PROCESSOR"]
    batches, facts = plugin_batches(corpus, processor)
    text_records = [int(index) for index in os.environ["QWEN3VL_PACKED_TEXT_ONLY"].split(",")]
    text_batches, text_facts = text_only_batches(corpus, processor, text_records)
    batches.update(text_batches)
    facts.update(text_facts)
    model = build_model(entry)
    seen = observe(model)
    result = {name: run_group(entry, model, group, seen) for name, group in batches.items()}
    result.update(facts)
    visual = model.model.model.visual
    result["deepstack_visual_indexes"] = list(visual.deepstack_visual_indexes)
    result["model_class"] = f"{type(model.model).__module__}.{type(model.model).__qualname__}"
    result["attn"] = {"vision": model.model.config.vision_config._attn_implementation,
                      "text": model.model.config.text_config._attn_implementation,
                      "text_layout": model.model.config.text_config.attn_layout}
    torch.save(result, os.environ["QWEN3VL_PACKED_OUT"])


if __name__ == "__main__":
    sys.exit(main())
