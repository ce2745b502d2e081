"""MindSpeed-MM's real ``VLMModel`` (Qwen2.5-VL, tiny, CPU) under ``--flow-loss-weighting``:
one packed batch of a caption and a text sample, forwarded three times.

Run by ``test_upstream_loss_weighting.py`` through :func:`harness.run_upstream` (``driver=``
this file), built on ``driver.py``'s initialisation, model and batches.  It records:

* ``plain``: the per-token losses in eval mode (the patch leaves evaluation alone, so this is
  upstream's own ``compute_language_model_loss``), and ``reference``: the same cross entropy
  taken here from the returned logits;
* ``weighted``: the per-token losses of two training-mode forwards (the patch active);
* ``labels`` / ``cu_seqlens`` / ``sample_ids`` of the batch, the stand-in report.
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
    weighted = [model(**batch)["loss_dict"]["loss"].detach().reshape(-1).tolist() for _ in range(2)]

    from torch_npu import _record
    result = {"plain": out["loss_dict"]["loss"].reshape(-1).tolist(), "reference": reference.tolist(),
              "weighted": weighted, "labels": labels.tolist(), "cu_seqlens": batch["cu_seqlens"].tolist(),
              "sample_ids": SAMPLE_IDS, "standin": _record.summary()}
    Path(driver.rank_path("result")).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
