"""Decoupled training with a data-parallel backbone: two backbone replicas (megatron-core's
GPTModel cut over PP=2 each) and one trainable ViT replica per backbone replica, six gloo
ranks built from one world with separate process groups (encoder group, backbone
data-parallel group per stage, one group per replica's slice).  Each backbone replica
trains its own half of the global batch, getting its microbatches' embeddings from the
shm pool under its own namespace and putting their gradients back to its slice's ViT;
then the backbone stages average over their data-parallel group and the ViTs over the
encoder group.  Loss and every gradient equal one process running the whole global batch
with Megatron's no-pipelining schedule (fp32, 1e-6)."""

from __future__ import annotations

import os

import pytest
import torch

from mindspeed_flow.decoupled import DecoupledLayout
from tests.runtime.test_vlm import MICROBATCHES
from markers import requires_megatron_core

pytestmark = requires_megatron_core

LAYOUT = DecoupledLayout(encoder_dp=1, backbone_pp=2, backbone_dp=2, max_ahead=2)


def _data_parallel(rank, world_size, state, name):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron_cpu_harness import global_name, layer_offset
    from tests.runtime.test_vlm import SPLIT, _batches, _vit
    from tiny_vlm import StageModule, forward_step, gpt_stage

    from mindspeed_flow.adapters.megatron.core import enable_cpu_shims
    from mindspeed_flow.pool import open_pool
    from mindspeed_flow.runtime import Binding, Executor

    shims = enable_cpu_shims()
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=LAYOUT.backbone_pp,
                                             order="tp-cp-ep-pp-dp")
    try:
        groups = LAYOUT.new_groups()
        replica = LAYOUT.replica(rank)
        mine = LAYOUT.microbatches(replica, MICROBATCHES)
        region, stage, _ = LAYOUT.role(rank)
        if region == "vit":
            module = _vit(frozen=False)
        else:
            assert parallel_state.get_pipeline_model_parallel_rank() == stage
            gpt = gpt_stage(SPLIT, stage, state)
            module = StageModule(gpt)
        pool = open_pool("shm", capacity_bytes=1 << 20, name=f"{name}-b{replica}", owner=f"rank{rank}", timeout_s=60)
        gets = []
        handle = pool.handle
        pool.handle = lambda key, timeout=None, producer=None: gets.append(handle(key, timeout, producer)) or gets[-1]
        batches = _batches()
        bindings = {(region, stage): Binding(module, iter([batches[m] for m in mine]))}
        ranks = LAYOUT.replica_ranks(replica)
        result = Executor(ranks.index(rank), ranks, group=groups["replica"], pool=pool).run(
            LAYOUT.plan(len(mine)), forward_step, bindings)
        dist.barrier()
        pool.close()
        LAYOUT.average_grads(module, groups)
        if region == "vit":
            grads = {f"vit.{n}": p.grad.clone() for n, p in module.named_parameters()}
        else:
            grads = {f"gpt.{global_name(n, layer_offset(gpt))}": p.grad.clone() for n, p in gpt.named_parameters()}
        losses = [float(d["loss"]) for d in result.forward_data_store]
        return mine, losses, grads, [(h.meta["key"], h.meta["microbatch"], h.meta["rank"], h.owner) for h in gets]
    finally:
        parallel_state.destroy_model_parallel()
        shims.remove()


def launch_against_reference(worker, world_size: int, name: str, pool_names: list[str]):
    """The single-process reference, then ``worker(rank, world_size, reference_weights,
    name)`` on ``world_size`` gloo ranks; the shm pools ``pool_names`` are destroyed after."""
    from megatron_cpu_harness import launch
    from tests.decoupled.test_step_vlm import _reference

    from mindspeed_flow.pool.shm import destroy

    (reference,) = launch(_reference, 1, timeout_s=180)
    try:
        ranks = launch(worker, world_size, reference[0], name, timeout_s=300)
    finally:
        for pool_name in pool_names:
            destroy(pool_name)
    return reference, ranks


@pytest.fixture(scope="module")
def runs():
    name = f"vlmdp{os.getpid()}"
    return launch_against_reference(_data_parallel, LAYOUT.world_size, name,
                                    [f"{name}-b{replica}" for replica in range(LAYOUT.backbone_dp)])

def test_layout_places_replicas_and_groups():
    assert LAYOUT.world_size == 6
    assert [LAYOUT.replica_ranks(r) for r in (0, 1)] == [[0, 2, 3], [1, 4, 5]]
    assert [LAYOUT.role(r) for r in range(6)] == [("vit", 0, 0), ("vit", 0, 0), ("llm", 0, 0), ("llm", 1, 0),
                                                   ("llm", 0, 0), ("llm", 1, 0)]
    assert [LAYOUT.microbatches(r, 4) for r in (0, 1)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="do not split over backbone_dp=2"):
        LAYOUT.microbatches(0, 3)
    with pytest.raises(ValueError, match="backbone_dp must be >= 1"):
        DecoupledLayout(backbone_dp=0)


def test_backbone_data_parallel_equals_single_process(runs):
    (_, ref_losses, ref_grads), ranks = runs
    for replica, (first, last) in enumerate([(2, 3), (4, 5)]):
        mine = ranks[last][0]
        assert ranks[last][1] == pytest.approx([ref_losses[m] for m in mine], rel=1e-6, abs=0)
        # the replica's first stage got its own microbatches' embeddings (numbered in its
        # plan, whose rank 0 is the ViT), put by its own ViT (global rank ``replica``)
        assert sorted(g for g in ranks[first][3] if g[0] == "vit.s0:act") == [
            ("vit.s0:act", m, 0, f"rank{replica}") for m in range(len(mine))]
        # and its ViT got their gradients back from that stage (plan rank 1)
        assert sorted(ranks[replica][3]) == [("vit.s0:grad", m, 1, f"rank{first}") for m in range(len(mine))]
    assert ranks[2][0] + ranks[4][0] == list(range(MICROBATCHES))
    vit = {n for n in ref_grads if n.startswith("vit.")}
    assert set(ranks[0][2]) == set(ranks[1][2]) == vit
    stage0, stage1 = set(ranks[2][2]), set(ranks[3][2])
    assert set(ranks[4][2]) == stage0 and set(ranks[5][2]) == stage1
    assert stage0 | stage1 | vit == set(ref_grads)
    for rank, (_, _, grads, _) in enumerate(ranks):
        for name, got in grads.items():
            torch.testing.assert_close(got, ref_grads[name], rtol=1e-6, atol=1e-7, msg=f"r{rank} {name}")
