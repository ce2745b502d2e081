"""Decoupled training of the tiny VLM (:mod:`mindspeed_flow.train.model`: its ViT, megatron-core's
GPTModel cut over PP=2) through the pool: two trainable ViT replicas on ranks of their own
put embeddings, the GPT pipeline on two other ranks gets them and puts their gradients
back.  Loss and every gradient equal one process running the whole VLM with Megatron's
no-pipelining schedule (fp32, 1e-6), on the shm, torch and mooncake backends.  The
embeddings' pool metadata names their microbatch and producing replica; gradients go back
to the owning replica; the replicas' reduced gradients agree over the encoder's own
process group.

Megatron's model-parallel state is built from the one world with pipelines of consecutive
ranks (``order="tp-cp-ep-pp-dp"``): ranks 2 and 3 are the GPT's stages 0 and 1; ranks 0
and 1 (the encoder's own group) build no GPT."""

from __future__ import annotations

import os

import pytest
import torch

from mindspeed_flow.decoupled import DecoupledLayout
from tests.runtime.test_vlm import MICROBATCHES
from markers import requires_megatron_core

pytestmark = requires_megatron_core

LAYOUT = DecoupledLayout(encoder_dp=2, backbone_pp=2, max_ahead=1)
BACKENDS = ("shm", "torch", "mooncake")


def _reference(rank, world_size):
    from tests.runtime.test_vlm import _reference_run

    return _reference_run(False)  # trainable ViT


def _decoupled(rank, world_size, state, name, mooncake):
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
        plan = LAYOUT.plan(MICROBATCHES)
        region, stage, _ = LAYOUT.role(rank)
        out = {}
        for backend in BACKENDS:
            if region == "vit":
                module = _vit(frozen=False)
                if rank == 1:  # only the plan's broadcast makes this replica right
                    with torch.no_grad():
                        for p in module.parameters():
                            p.add_(0.5)
            else:
                gpt = gpt_stage(SPLIT, stage, state)
                module = StageModule(gpt)
            options: dict = {"name": f"{name}-{backend}", "timeout_s": 60}
            if backend != "torch":
                options["owner"] = f"rank{rank}"
            if backend == "mooncake":
                options.update(mooncake)
            pool = open_pool(backend, capacity_bytes=1 << 20, **options)
            seen = _record_handles(pool)
            bindings = {(region, stage): Binding(module, iter(_batches()))}
            result = Executor(rank, list(range(world_size)), pool=pool).run(plan, forward_step, bindings)
            dist.barrier()
            pool.close()
            if region == "vit":
                grads = {f"vit.{n}": p.grad.clone() for n, p in module.named_parameters()}
                _check_replicas_agree(grads, groups["vit"])
            else:
                grads = {f"gpt.{global_name(n, layer_offset(gpt))}": p.grad.clone() for n, p in gpt.named_parameters()}
            out[backend] = ([float(d["loss"]) for d in result.forward_data_store], grads, [h.meta for h in seen])
        return out
    finally:
        parallel_state.destroy_model_parallel()
        shims.remove()


def _record_handles(pool) -> list:
    """The handles of what this rank got from the pool (the pool itself is real)."""
    seen = []
    lookup = pool.handle

    def handle(key, timeout=None, producer=None):
        seen.append(lookup(key, timeout, producer))
        return seen[-1]

    pool.handle = handle
    return seen


def _check_replicas_agree(grads: dict, group) -> None:
    """The replicas' reduced gradients are identical, checked over the encoder's own group."""
    import torch.distributed as dist

    flat = torch.cat([g.reshape(-1) for g in grads.values()])
    gathered = [torch.empty_like(flat) for _ in LAYOUT.encoder_ranks]
    dist.all_gather(gathered, flat, group=group)
    assert all(torch.equal(gathered[0], g) for g in gathered), "encoder replicas disagree"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_cpu_harness import launch

    from mindspeed_flow.pool.mooncake import MooncakeServer
    from mindspeed_flow.pool.shm import destroy

    (reference,) = launch(_reference, 1, timeout_s=180)
    name = f"vlm{os.getpid()}"
    with MooncakeServer(log=tmp_path_factory.mktemp("mooncake") / "master.log") as server:
        try:
            # opted in: a Mooncake client listens beyond loopback whatever it is told (docs/pool.md)
            ranks = launch(_decoupled, LAYOUT.world_size, reference[0], name,
                           {**server.options, "listen_beyond_loopback": True}, timeout_s=300)
        finally:
            destroy(name)
    return reference, ranks


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoupled_vlm_equals_single_process(runs, backend):
    (_, ref_losses, ref_grads), ranks = runs
    found = [r[backend] for r in ranks]
    assert [f[0] for f in found[:3]] == [[], [], []]
    assert found[3][0] == pytest.approx(ref_losses, rel=1e-6, abs=0)
    embeddings = sorted((h for h in found[2][2] if h["key"] == "vit.s0:act"), key=lambda h: h["microbatch"])
    assert [(h["microbatch"], h["rank"]) for h in embeddings] == [
        (m, m % 2) for m in range(MICROBATCHES)]  # by replica m % 2
    grads_back = [h for r in (0, 1) for h in found[r][2]]
    assert sorted(h["microbatch"] for h in grads_back) == list(range(MICROBATCHES))
    assert all(h["key"] == "vit.s0:grad" and h["rank"] == 2 for h in grads_back)
    vit = {n for n in ref_grads if n.startswith("vit.")}
    assert vit and set(found[0][1]) == vit and set(found[1][1]) == vit  # both replicas hold the sum
    assert set(found[2][1]) | set(found[3][1]) | vit == set(ref_grads)
    for rank, (_, grads, _) in enumerate(found):
        for name, got in grads.items():
            torch.testing.assert_close(got, ref_grads[name], rtol=1e-6, atol=1e-7, msg=f"r{rank} {name}")
