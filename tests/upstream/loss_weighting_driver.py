"""MindSpeed-MM's real ``VLMModel`` (Qwen2.5-VL, tiny, CPU) under ``--flow-loss-weighting``:
one packed batch of a caption and a text sample, forwarded in eval mode, then in training
mode twice, then saved with Megatron's real ``save_checkpoint`` (``--ckpt-format torch``),
forwarded a third time (the uninterrupted run), loaded back with the real
``load_checkpoint`` into a weighting started afresh (the resumed job) and forwarded again.

Run by ``test_upstream_loss_weighting.py`` through :func:`harness.run_upstream` (``driver=``
this file), built on ``driver.py``'s initialisation, model and batches.  It records:

* ``plain``: the per-token losses in eval mode (the patch leaves evaluation alone, so this is
  upstream's own ``compute_language_model_loss``), and ``reference``: the same cross entropy
  taken here from the returned logits;
* ``weighted``: the per-token losses of two training-mode forwards (the patch active);
* ``saved``: the ``flow_loss_weighting`` entry of the written ``mp_rank_00`` file, and
  ``before_save``: the weighting's state when it was saved;
* ``uninterrupted`` / ``resumed``: the third training forward's per-token losses and the
  weighting's state after it, without and with the save / load in between;
* ``labels`` / ``cu_seqlens`` / ``sample_ids`` of the batch, the stand-in report.

The model's weights do not change (no optimizer step), so the resumed forward must equal the
uninterrupted one exactly when the weights were restored.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

import driver  # first: MindSpeed's adaptor, Megatron's argument parsing (the script's folder is on sys.path)

SAMPLE_IDS = ["data/caption-0000.jsonl:0", "data/text-0000.jsonl:0"]


def main() -> None:
    from megatron.core.enums import ModelType
    from megatron.training import get_args
    from megatron.training.training import get_model

    logging.basicConfig(level=logging.INFO)
    driver.initialise()
    (model,) = get_model(driver.model_provider, ModelType.encoder_or_decoder)
    (batch,) = driver.microbatches()
    batch = {k: (v.to(get_args().params_dtype) if torch.is_floating_point(v) else v) for k, v in batch.items()}
    batch["sample_ids"] = SAMPLE_IDS

    model.eval()
    with torch.no_grad():
        out = model(**batch)
    labels = batch["labels"][0, 1:]
    reference = torch.nn.functional.cross_entropy(out["logits"][0, :-1].float(), labels, reduction="none")
    model.train()
    weighted = [token_losses(model, batch) for _ in range(2)]
    checkpoint = save_and_resume(model, batch)

    from torch_npu import _record
    result = {"plain": out["loss_dict"]["loss"].reshape(-1).tolist(), "reference": reference.tolist(),
              "weighted": weighted, "labels": labels.tolist(), "cu_seqlens": batch["cu_seqlens"].tolist(),
              "sample_ids": SAMPLE_IDS, "standin": _record.summary(), **checkpoint}
    Path(driver.rank_path("result")).write_text(json.dumps(result))


def token_losses(model, batch: dict) -> list[float]:
    return model(**batch)["loss_dict"]["loss"].detach().reshape(-1).tolist()


def save_and_resume(model, batch: dict) -> dict:
    """Megatron's own save at iteration 1 (``--save``), the uninterrupted third forward, a
    fresh weighting (as a new job), Megatron's own load of the checkpoint, the resumed one."""
    from megatron.training import get_args
    from megatron.training.checkpointing import get_checkpoint_name, load_checkpoint, save_checkpoint

    from mindspeed_flow.adapters.mindspeed_mm import loss as mindspeed_mm_loss

    args = get_args()
    before_save = mindspeed_mm_loss.current_weighting().state_dict()
    save_checkpoint(1, [model], None, None, 0)
    saved = torch.load(get_checkpoint_name(args.save, 1), weights_only=False)["flow_loss_weighting"]
    uninterrupted = token_losses(model, batch), mindspeed_mm_loss.current_weighting().state_dict()

    mindspeed_mm_loss.reset()
    args.load, args.no_load_optim, args.no_load_rng = args.save, True, True
    iteration, _ = load_checkpoint([model], None, None)
    resumed = token_losses(model, batch), mindspeed_mm_loss.current_weighting().state_dict()
    return {"before_save": before_save, "saved": saved, "loaded_iteration": iteration,
            "uninterrupted": uninterrupted, "resumed": resumed}


if __name__ == "__main__":
    main()
