"""Decoupled training with a tensor-parallel encoder: one ViT replica split over a TP group
of two gloo ranks (patch embedding column-parallel, layer row-parallel, projector
replicated: :mod:`mindspeed_flow.pool.encoder_tp`), megatron-core's GPTModel cut over PP=2
on two other ranks.  Both TP ranks hold the whole embeddings; only the TP leader is a rank
of the plan and puts them into the shm pool, gets their gradient and broadcasts it; the
other TP rank follows the leader's program.  Loss and every gradient (each TP rank's
shard of the reference's) equal one process running the whole VLM (fp32, 1e-6)."""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch
from torch import nn

from mindspeed_flow.pool.decoupled import DecoupledLayout

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install 'mindspeed-flow[megatron]')",
)

SLICE = DecoupledLayout(encoder_dp=1, backbone_pp=2, max_ahead=2)
TP = 2
PLAN_RANKS = [0, 2, 3]  # plan rank -> global rank: the TP leader, then the GPT's stages
SHARDS = {"vit.patch.weight": 0, "vit.patch.bias": 0, "vit.layer.weight": 1}  # else replicated


class TensorParallelViT(nn.Module):
    """``tiny_vlm.ViT``'s math with its patch and layer linears split over ``group``."""

    def __init__(self, full: nn.Module, group) -> None:
        super().__init__()
        from mindspeed_flow.pool.encoder_tp import ColumnParallelLinear, RowParallelLinear

        self.patch = ColumnParallelLinear(full.patch, group)
        self.layer = RowParallelLinear(full.layer, group)
        self.projector = copy.deepcopy(full.projector)

    def forward(self, batch: dict) -> torch.Tensor:
        return self.projector(torch.tanh(self.layer(self.patch(batch["pixels"]))))


def _tensor_parallel(rank, world_size, state, name):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron_cpu_harness import build_stage_model, global_name, layer_offset
    from test_runtime_vlm import MICROBATCHES, _batches, _spec, _vit
    from tiny_vlm import TextStage, forward_step

    from mindspeed_flow.adapters.megatron_core import enable_cpu_shims
    from mindspeed_flow.pool import open_pool
    from mindspeed_flow.pool.encoder_tp import LeaderOutput, follow
    from mindspeed_flow.runtime import Binding, Executor

    shims = enable_cpu_shims()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=SLICE.backbone_pp,
                                             order="tp-cp-ep-pp-dp")
    try:
        tp_group, plan_group = dist.new_group(list(range(TP))), dist.new_group(PLAN_RANKS)
        spec, plan = _spec(), SLICE.plan(MICROBATCHES)
        batches = _batches(spec)
        if rank < TP:
            vit = TensorParallelViT(_vit(spec, frozen=False), tp_group)
            params = {f"vit.{n}": p for n, p in vit.named_parameters()}
        if rank == 1:
            follow(plan.programs[0], "vit", vit, batches, tp_group, leader=0)
            return [], {n: p.grad.clone() for n, p in params.items()}
        region, stage = SLICE.role(PLAN_RANKS.index(rank))
        if region == "vit":
            module = LeaderOutput(vit, tp_group, leader=0)
        else:
            gpt = build_stage_model(spec, state)
            module = TextStage(gpt, stage == 0)
            params = {f"gpt.{global_name(n, layer_offset(gpt))}": p for n, p in gpt.named_parameters()}
        pool = open_pool("shm", capacity_bytes=1 << 20, name=name, owner=f"rank{rank}", timeout_s=60)
        result = Executor(PLAN_RANKS.index(rank), PLAN_RANKS, group=plan_group, pool=pool).run(
            plan, forward_step, {(region, stage): Binding(module, iter(batches))})
        dist.barrier(plan_group)
        pool.close()
        return [float(d["loss"]) for d in result.forward_data_store], {n: p.grad.clone() for n, p in params.items()}
    finally:
        parallel_state.destroy_model_parallel()
        shims.remove()


@pytest.fixture(scope="module")
def runs():
    from test_pool_decoupled_dp import launch_against_reference

    name = f"vlmtp{os.getpid()}"
    return launch_against_reference(_tensor_parallel, 4, name, [name])

def test_tensor_parallel_encoder_equals_single_process(runs):
    (_, ref_losses, ref_grads), ranks = runs
    assert ranks[3][0] == pytest.approx(ref_losses, rel=1e-6, abs=0)
    vit = {n for n in ref_grads if n.startswith("vit.")}
    assert set(ranks[0][1]) == set(ranks[1][1]) == vit
    assert set(ranks[2][1]) | set(ranks[3][1]) | vit == set(ref_grads)
    for rank, (_, grads) in enumerate(ranks):
        for name, got in grads.items():
            want = ref_grads[name]
            if rank < TP and name in SHARDS:
                want = want.chunk(TP, SHARDS[name])[rank]
                assert got.shape[SHARDS[name]] * TP == ref_grads[name].shape[SHARDS[name]]
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"r{rank} {name}")

