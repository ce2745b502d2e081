"""One upstream training step under FlowTrain's decoupled layout: MindSpeed's adaptor,
Megatron's initialisation and MindSpeed-MM's ``VLMModel``, with the plugin's decoupled
patches (:mod:`mindspeed_flow.patches.pool`, on under ``--use-flowtrain``): encoder ranks build ViT + projector,
backbone ranks their LLM stage, each role with Megatron's groups over its own ranks, and
``get_forward_backward_func`` runs the slice's plan through the runtime and the pool.

Run by ``test_real_job_decoupled.py`` under torchrun as ``python -m mindspeed_flow.launch
decoupled_driver.py ARGS --use-flowtrain``; the job JSON (``MINDSPEED_FLOW_HARNESS_JOB``)
is :mod:`driver`'s plus ``decoupled``: the layout's fields.  Each rank trains its slice's
share of the samples (one per microbatch, or the job's ``packs``: packs of them, as the
packing loader makes them, with ``cu_seqlens`` and per-sample M-RoPE ids) and writes its loss, token count, gradients
(fp32 ``main_grad`` by global name) and role.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import driver  # (MindSpeed's adaptor first, as pretrain_vlm.py; the job JSON)


def decoupled_layout(fields: dict):
    """The layout the job describes (``flow_encoder_cost``: its terms, as a layout file writes them inline)."""
    from mindspeed_flow.decoupled import DecoupledLayout
    from mindspeed_flow.flow import EncoderCost

    if fields.get("flow_encoder_cost") is not None:
        fields = {**fields, "flow_encoder_cost": EncoderCost.from_terms(fields["flow_encoder_cost"], "job.json")}
    return DecoupledLayout(**fields)


def dying(forward_step, rank: int):
    """``forward_step``, or on the rank the job JSON's ``die`` names, one that ends the
    process (``os._exit``, as a crash or an OOM kill would: no clean-up of its own) at its
    ``call``-th forward, mid-step (the fault test)."""
    die = driver.JOB.get("die")
    if not die or die["rank"] != rank:
        return forward_step
    import os

    calls = [0]

    def forward_then_die(data_iterator, model):
        calls[0] += 1
        if calls[0] == die["call"]:
            print(f"[decoupled driver] rank {rank} dies at forward {calls[0]}", flush=True)
            os._exit(die.get("code", 17))
        return forward_step(data_iterator, model)

    return forward_then_die


def optimizer_grad_norm(model) -> float:
    """The gradient norm Megatron's own optimizer (fp32, no distributed optimizer) would clip
    by with ``--clip-grad``: the number every rank must agree on, the whole model's."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0), model)
    optimizer.prepare_grads()
    return float(optimizer.get_grad_norm())


def log_pool_names() -> None:
    """The decoupled step's log (rank 0 names the pools it opens) on this run's output, as
    ``pretrain_vlm.py``'s logging shows it, so the fault test can check those pools are gone."""
    import logging

    logger = logging.getLogger("mindspeed_flow.adapters.megatron.decoupled_step")
    logger.setLevel(logging.INFO)
    logger.addHandler(logging.StreamHandler(sys.stdout))


def main() -> None:
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config
    from megatron.training.training import get_model

    from mindspeed_flow.adapters.megatron import roles

    log_pool_names()
    layout = decoupled_layout(driver.JOB["decoupled"])
    roles.configure(layout)
    driver.initialise()
    model = get_model(driver.model_provider, ModelType.encoder_or_decoder)
    if driver.JOB.get("load"):
        driver.load_initial_weights(model)
    rank = torch.distributed.get_rank()
    role = layout.role(rank)
    replica = layout.replica(rank)
    samples = [driver.sample_tensors(spec) for spec in driver.JOB["samples"]]
    packs = driver.JOB.get("packs")  # the slice's packs, as the packing loader hands them
    if packs and isinstance(packs[0][0], list):  # several backbone replicas: each slice's own
        packs = packs[replica]
    if packs:
        batches = [driver.packed_batch([samples[i] for i in pack]) for pack in packs]
    else:
        batches = [samples[i] for i in layout.microbatches(replica, len(samples))]
    config = get_model_config(model[0])
    config.finalize_model_grads_func = finalize_model_grads
    for chunk in model:
        chunk.zero_grad_buffer()
    forward_backward = get_forward_backward_func()
    step = dying(driver.forward_step, rank)
    losses = forward_backward(forward_step_func=step, data_iterator=iter(batches), model=model,
                              num_microbatches=get_num_microbatches(), seq_length=256, micro_batch_size=1,
                              forward_only=False)
    result = {"rank": rank, "region": role.region, "stage": role.stage, "replica": replica,
              "plan_rank": layout.executor_ranks(rank).index(rank), "microbatches": len(batches),
              "megatron_microbatches": get_num_microbatches(),
              "forward_backward_func": f"{forward_backward.__module__}:{forward_backward.__qualname__}",
              "parameters": sorted(driver.global_name(n) for c in model for n, _ in c.named_parameters())}
    from megatron.core import mpu
    result["groups"] = {
        "tp": torch.distributed.get_process_group_ranks(mpu.get_tensor_model_parallel_group()),
        "pp": torch.distributed.get_process_group_ranks(mpu.get_pipeline_model_parallel_group()),
        "dp": torch.distributed.get_process_group_ranks(mpu.get_data_parallel_group()),
        "mp": torch.distributed.get_process_group_ranks(mpu.get_model_parallel_group()),
    }
    if role.region == "llm" and role.stage == layout.backbone_pp - 1:
        result["loss_sum"] = sum(float(item["loss"][0]) for item in losses)
        result["tokens"] = sum(float(item["loss"][1]) for item in losses)
    torch.save(driver.gradients(model), driver.rank_path("grads"))
    result["grad_norm"] = optimizer_grad_norm(model)
    from mindspeed_flow.adapters.megatron import decoupled_step
    result["pool_backend"] = decoupled_step.STATE.backend
    result["pool_name"] = decoupled_step.STATE.pool_name
    from mindspeed_flow.adapters.megatron import decoupled_flow
    result["flow"] = decoupled_flow.FLOW.last  # the flow's groupings and transfers (test_real_job_flow)
    decoupled_step.close()
    torch.distributed.barrier()
    Path(driver.rank_path("result")).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    sys.exit(0)
