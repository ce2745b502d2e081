"""Decoupled training through the pool: two encoder replicas (a trainable ViT + projector)
produce embeddings into the pool, a two-stage backbone pipeline consumes them, gradients
flow back through the pool to the owning replica, which reduces its weight gradients with
the other replica only.  Loss and every gradient equal a single process (fp32, 1e-6) on
the shm, torch and mooncake backends (one 4-process gloo world runs all three)."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_cpu_harness import launch
from mindspeed_flow.pool import open_pool
from mindspeed_flow.pool.decoupled import DecoupledLayout
from mindspeed_flow.runtime import Binding, Executor
from runtime_models import PATCHES, TOKENS, build, forward_step, grads_of, make_batches, reference

MICROBATCHES = 4
LAYOUT = DecoupledLayout(encoder_dp=2, backbone_pp=2, max_ahead=1)
BACKENDS = ("shm", "torch", "mooncake")


def _worker(rank: int, world_size: int, name: str, mooncake: dict) -> dict:
    import torch.distributed as dist

    groups = LAYOUT.new_groups()
    plan = LAYOUT.plan(MICROBATCHES)
    region, stage = LAYOUT.role(rank)
    out = {}
    for backend in BACKENDS:
        parts = build()
        if rank == 1:  # the second replica starts from other weights: only the broadcast fixes it
            with torch.no_grad():
                for p in parts["vit"].parameters():
                    p.add_(1.0)
        part_name = "vit" if region == "vit" else f"llm{stage}"
        options: dict = {"name": f"{name}-{backend}", "timeout_s": 60}
        if backend != "torch":
            options["owner"] = f"rank{rank}"
        if backend == "mooncake":
            options.update(mooncake)
        pool = open_pool(backend, capacity_bytes=1 << 20, **options)
        seen = _record_handles(pool)
        bindings = {(region, stage): Binding(parts[part_name], iter(_with_samples(make_batches(MICROBATCHES))))}
        result = Executor(rank, list(range(world_size)), pool=pool).run(plan, forward_step, bindings)
        dist.barrier()  # every consumer has read before a producer's segment goes
        pool.close()
        grads = grads_of({part_name: parts[part_name]})
        if region == "vit":  # the replicas' reduced gradients agree, checked over the encoder's own group
            flat = torch.cat([g.reshape(-1) for g in grads.values()])
            gathered = [torch.empty_like(flat) for _ in LAYOUT.encoder_ranks]
            dist.all_gather(gathered, flat, group=groups["vit"])
            assert all(torch.equal(gathered[0], g) for g in gathered), "encoder replicas disagree"
        out[backend] = {"losses": [float(d["loss"]) for d in result.forward_data_store], "grads": grads,
                        "meta": [h.meta for h in seen]}
    return out


def _with_samples(batches: list[dict]) -> list[dict]:
    """Each microbatch names its samples and their token counts."""
    return [{**b, "sample_ids": [10 * m, 10 * m + 1], "token_counts": [len(b["tokens"]), b["pixels"].shape[0]]}
            for m, b in enumerate(batches)]


def _record_handles(pool) -> list:
    """The handles of what this rank got from the pool (the pool itself is real)."""
    seen = []
    lookup = pool.handle

    def handle(key, timeout=None, producer=None):
        seen.append(lookup(key, timeout, producer))
        return seen[-1]

    pool.handle = handle
    return seen


@pytest.fixture(scope="module")
def decoupled(tmp_path_factory):
    from mindspeed_flow.pool.mooncake import MooncakeServer
    from mindspeed_flow.pool.shm import destroy

    name = f"dec{os.getpid()}"
    with MooncakeServer(log=tmp_path_factory.mktemp("mooncake") / "master.log") as server:
        try:
            ranks = launch(_worker, LAYOUT.world_size, name, server.options, timeout_s=240)
        finally:
            destroy(name)
    return reference(build(), make_batches(MICROBATCHES)), ranks


@pytest.mark.parametrize("backend", BACKENDS)
def test_decoupled_step_equals_single_process(decoupled, backend):
    (ref_losses, ref_grads), ranks = decoupled
    assert "vit.vit.weight" in ref_grads  # a trainable encoder
    found = [r[backend] for r in ranks]
    assert [f["losses"] for f in found[:3]] == [[], [], []]
    assert found[3]["losses"] == pytest.approx(ref_losses, rel=1e-6, abs=0)
    embeddings = sorted((h for h in found[2]["meta"] if h["key"] == "vit.s0:act"), key=lambda h: h["microbatch"])
    assert [(h["microbatch"], h["rank"], h["sample_ids"], h["token_counts"]) for h in embeddings] == [
        (m, m % 2, [10 * m, 10 * m + 1], [TOKENS, PATCHES[m]]) for m in range(MICROBATCHES)]  # by replica m % 2
    grads_back = [h for r in (0, 1) for h in found[r]["meta"]]
    assert sorted(h["microbatch"] for h in grads_back) == list(range(MICROBATCHES))
    assert all(h["key"] == "vit.s0:grad" and h["rank"] == 2 for h in grads_back)
    owners = {0: "vit.", 1: "vit.", 2: "llm0.", 3: "llm1."}
    for rank, prefix in owners.items():
        mine = {n: g for n, g in ref_grads.items() if n.startswith(prefix)}
        assert set(found[rank]["grads"]) == set(mine)
        for n, expected in mine.items():
            torch.testing.assert_close(found[rank]["grads"][n], expected, rtol=1e-6, atol=1e-7, msg=f"r{rank} {n}")


def test_layout_roles_and_plan():
    plan = LAYOUT.plan(MICROBATCHES)
    assert [LAYOUT.role(r) for r in range(4)] == [("vit", 0), ("vit", 0), ("llm", 0), ("llm", 1)]
    kinds = {r: [a.kind.value for a in p] for r, p in plan.programs.items()}
    assert kinds[0].count("PUT") == 2 and kinds[0].count("GET") == 2 and kinds[0][-1] == "REDUCE"
    assert "PUT" not in kinds[3] and "GET" not in kinds[3]
    with pytest.raises(ValueError, match="rank 4 outside"):
        LAYOUT.role(4)
