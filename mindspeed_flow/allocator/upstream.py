"""The upstream arguments that realise a plan.

Megatron takes the backbone's sizes on the command line; MindSpeed-MM reads per-module
layer splits from its model JSON (``pipeline_num_layers`` of ``image_encoder.vision_encoder``
and ``text_decoder``, one entry per pipeline stage) and, under ``--hetero-parallel``, a
module's own ``tensor_model_parallel_size`` from the same JSON
(``mindspeed_mm/utils/hetero_parallel.py``).  The encoder's replicas on devices of their
own are what FlowTrain's decoupled schedule runs; upstream alone places the encoder with
the backbone (the vision encoder on stage 0), with its own TP.  A co-located plan is
upstream's own layout: the encoder in stage 0 with the backbone's TP, the text decoder's
split holding fewer layers on stage 0.
"""

from __future__ import annotations

from typing import Any

from .errors import AllocatorError
from .plan import COLOCATED, AllocationPlan


def megatron_split_settings(split: tuple[int, ...]) -> dict[str, int]:
    """Megatron's ``decoder_first/last_pipeline_num_layers`` for a layer split (none when
    even): Megatron splits evenly but for its first and last stage, so any other split is
    refused rather than silently evened out."""
    if len(set(split)) <= 1:
        return {}
    if len(set(split[1:-1])) > 1:
        raise AllocatorError(f"Megatron cannot express the layer split {list(split)} "
                             "(only the first and last stage may differ)")
    return {"decoder_first_pipeline_num_layers": split[0], "decoder_last_pipeline_num_layers": split[-1]}


def megatron_args(plan: AllocationPlan) -> list[str]:
    """Megatron-LM flags for the backbone's parallel sizes, layer split and batch."""
    bb = plan.backbone
    args = ["--tensor-model-parallel-size", str(bb.tp),
            "--pipeline-model-parallel-size", str(bb.pp),
            "--micro-batch-size", str(bb.micro_batch),
            "--global-batch-size", str(plan.global_batch)]
    for name, value in megatron_split_settings(bb.layer_split).items():
        args += ["--" + name.replace("_", "-"), str(value)]
    if bb.tp > 1:
        args.append("--sequence-parallel")
    return args


def mindspeed_mm_model(plan: AllocationPlan) -> dict[str, Any]:
    """The entries of MindSpeed-MM's model JSON that the plan sets."""
    pp = plan.backbone.pp
    return {
        "image_encoder": {"vision_encoder": {
            "pipeline_num_layers": [plan.encoder.layers] + [0] * (pp - 1),
            "tensor_model_parallel_size": plan.encoder.tp,
        }},
        "text_decoder": {"pipeline_num_layers": list(plan.backbone.layer_split)},
    }


def mindspeed_mm_args(plan: AllocationPlan) -> list[str]:
    """Megatron's flags, plus ``--hetero-parallel`` (the encoder's own TP) when the encoder
    has a TP of its own."""
    if plan.placement == COLOCATED or plan.encoder.tp == plan.backbone.tp:
        return megatron_args(plan)
    return megatron_args(plan) + ["--hetero-parallel"]
