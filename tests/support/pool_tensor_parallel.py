"""Decoupled training with tensor parallelism on both sides, as one worker for
:func:`megatron_cpu_harness.launch`: any :class:`DecoupledLayout` (encoder DP x TP,
backbone DP x TP x PP) of the tiny VLM, from one gloo world.

The ViT's MLPs (each block's and the merger's) are column-parallel then row-parallel over
the encoder replica's TP group (:mod:`encoder_tp`, beside it), the rest replicated; the
backbone is megatron-core's ``GPTModel`` under Megatron's own tensor and pipeline
parallelism (its parallel state built from the one world with the layout's
``megatron_parallel_kwargs``), each TP rank loading its shard of the single-process
reference's weights.  Every TP rank runs its slice's plan; only TP leaders talk to the pool
(``shm`` or ``torch``, whose group is the slice's pool ranks:
:class:`~mindspeed_flow.pool.tensor_parallel.TensorParallelPool`)."""

from __future__ import annotations

import copy

import torch
from torch import nn


def tensor_parallel_vit(full: nn.Module, group) -> nn.Module:
    """A copy of the tiny VLM's ViT (``full``, a :class:`~mindspeed_flow.train.vision.VisionEncoder`)
    with the two linears of each MLP (every block's and the merger's) split over ``group``,
    Megatron's column-then-row pairing; patch embedding, norms and attention replicated.
    Parameter names stay ``full``'s, so gradients compare name by name."""
    from encoder_tp import ColumnParallelLinear, RowParallelLinear

    encoder = copy.deepcopy(full)
    for mlp in [block.mlp for block in encoder.blocks] + [encoder.merger.mlp]:
        mlp[0], mlp[2] = ColumnParallelLinear(mlp[0], group), RowParallelLinear(mlp[2], group)
    return encoder


def partition_dim(param: torch.Tensor) -> int | None:
    """The dimension Megatron's (or :mod:`encoder_tp`'s) tensor parallelism splits
    ``param`` along; ``None`` for a replicated parameter."""
    return param.partition_dim if getattr(param, "tensor_model_parallel", False) else None


def shard(full: torch.Tensor, dim: int | None, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s part of ``full`` (all of it when ``dim`` is ``None``)."""
    return full if dim is None else full.chunk(tp, dim)[tp_rank]


def load_shards(gpt: nn.Module, state: dict, tp_rank: int, tp: int) -> None:
    """Load this TP rank's shard of the reference's (global-name) state into its stage."""
    from megatron_cpu_harness import stage_state_dict

    params = dict(gpt.named_parameters())
    local = {name: (shard(value, partition_dim(params[name]), tp_rank, tp) if name in params else value)
             for name, value in stage_state_dict(state, gpt).items()}
    gpt.load_state_dict(local, strict=True)


def decoupled_worker(rank, world_size, state, name, layout, backend):
    """This rank's part of one step; returns its role, microbatches, losses, gradients
    (``name -> (grad, partition dim)``) and what its pool served it."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron_cpu_harness import global_name, layer_offset
    from tests.runtime.test_vlm import LAYERS, MICROBATCHES, _batches, _vit
    from tiny_vlm import StageModule, forward_step, gpt_stage

    from mindspeed_flow.adapters.megatron.core import enable_cpu_shims
    from mindspeed_flow.pool import open_pool
    from mindspeed_flow.pool.tensor_parallel import TensorParallelPool
    from mindspeed_flow.runtime import Binding, Executor

    shims = enable_cpu_shims()
    parallel_state.initialize_model_parallel(**layout.megatron_parallel_kwargs())
    try:
        groups = layout.new_groups()
        role, replica = layout.role(rank), layout.replica(rank)
        mine = layout.microbatches(replica, MICROBATCHES)
        batches = _batches()
        if role.region == "vit":
            vit = tensor_parallel_vit(_vit(frozen=False), groups["tp"])
            if layout.executor_ranks(rank).index(rank) % 2:  # only the plan's broadcast makes it right
                with torch.no_grad():
                    for p in vit.parameters():
                        p.add_(0.5)
            module = vit
            params = {f"vit.{n}": p for n, p in vit.named_parameters()}
        else:
            assert (parallel_state.get_pipeline_model_parallel_rank(),
                    parallel_state.get_tensor_model_parallel_rank()) == (role.stage, role.tp_rank)
            assert dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group()) == \
                layout.tp_group_ranks(rank)
            pp = layout.backbone_pp
            gpt = gpt_stage([LAYERS // pp] * pp, role.stage)
            load_shards(gpt, state, role.tp_rank, layout.backbone_tp)
            module = StageModule(gpt)
            params = {f"gpt.{global_name(n, layer_offset(gpt))}": p for n, p in gpt.named_parameters()}
        leader = layout.tp_group_ranks(rank)[0]
        pool, gets = None, []
        if rank in layout.pool_ranks(replica):  # TP leaders of encoder replicas and first backbone stages
            where = {"group": groups["pool"]} if backend == "torch" else {"owner": f"rank{rank}"}
            pool = open_pool(backend, capacity_bytes=1 << 20, name=f"{name}-b{replica}", timeout_s=60, **where)
            handle = pool.handle
            pool.handle = lambda key, timeout=None, producer=None: gets.append(
                handle(key, timeout, producer)) or gets[-1]
        ranks = layout.executor_ranks(rank)
        view = TensorParallelPool(pool, groups["tp"], leader) if role.stage == 0 else None
        result = Executor(ranks.index(rank), ranks, group=groups["replica"], pool=view).run(
            layout.plan(len(mine)), forward_step, {role.binding: Binding(module, iter([batches[m] for m in mine]))})
        dist.barrier()
        if pool is not None:
            pool.close()
        layout.average_grads(module, groups)
        return {"role": tuple(role), "microbatches": mine,
                "losses": [float(d["loss"]) for d in result.forward_data_store],
                "grads": {n: (p.grad.clone(), partition_dim(p)) for n, p in params.items()},
                "gets": [(h.meta["key"], h.meta["microbatch"], h.owner) for h in gets]}
    finally:
        parallel_state.destroy_model_parallel()
        shims.remove()
