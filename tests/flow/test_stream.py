"""The flow's runtime on real gloo processes and a real ``shm`` (and ``torch``) pool: two encoder replicas
(:class:`EmbeddingProducer`) put one entry per sample, the backbone (plain PyTorch tiny VLM,
:mod:`tiny_vlm`) runs each replica's microbatches through the :class:`Executor`'s 1F1B with
its first stage taking the embeddings by sample (:class:`EmbeddingConsumer`).

Against one process running the same step's samples one at a time (per-token step loss):
- parity, at backbone PP=1 x DP=2 and PP=2 x DP=1: the step loss and every gradient (ViT
  when trainable, each backbone stage after the DP sum), frozen and trainable ViT, images of
  1 to 12 tokens (one sample with two images, one with none);
- the encoder's batches and the LLM's microbatches differ, and every sample reaches the
  backbone exactly once;
- back-pressure: each producer's segment is smaller than what it puts in the step (and at
  most 3 entries in flight), the step still equals the reference;
- a frozen producer runs ahead: the backbone holds its last step-0 microbatch until step 1's
  first embeddings of every producer are in the pool, so the step can only end if the
  producers encoded into step 1 before the backbone finished step 0; each batch is encoded once;
- the ``torch`` pool backend (point-to-point over gloo, the index in the job's store)
  instead of ``shm``: the trainable step's parity and sample checks hold on it too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from functools import lru_cache

import pytest
import torch

from mindspeed_flow.data.conversation import IGNORE
from mindspeed_flow.data.images import MERGE
from mindspeed_flow.flow import EncoderCost, SampleMeta, group_step
from mindspeed_flow.flow.ranks import FlowRanks
from mindspeed_flow.packing import CostModel
from mindspeed_flow.train.batches import ModelBatch
from mindspeed_flow.train.vision import PATCH_ROW

ENCODERS = 2
MICROBATCHES = 4
TOKENS_PER_MICROBATCH = 32
# per step: (image tokens of each image, text tokens) of each sample
STEPS = (
    [((2,), 6), ((8,), 4), ((1,), 7), ((), 9), ((3, 2), 5), ((12,), 3), ((1,), 4), ((5,), 6), ((2,), 5), ((4,), 8)],
    [((6,), 5), ((1,), 9), ((10,), 2), ((2,), 4), ((), 6), ((3,), 7), ((7,), 3), ((2, 1), 4)],
)
LARGE = 1 << 20


@dataclass(frozen=True)
class Scenario:
    """One run of the flow: ``steps`` steps; each producer's and consumer's segment is
    ``capacity`` bytes; ``hold``: the backbone waits for step 1's first embeddings before its
    last step-0 microbatch."""

    name: str
    frozen: bool
    steps: int = 1
    capacity: int = LARGE
    max_in_flight: int | None = None
    hold: bool = False
    backend: str = "shm"  # the pool's: shm (one node's processes) or torch (point-to-point over gloo)


def _config():
    from tiny_vlm import PLAIN

    return replace(PLAIN, seed=11)


# --------------------------------------------------------------------------- the samples


@dataclass(frozen=True)
class Sample:
    meta: SampleMeta
    input_ids: torch.Tensor
    labels: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


@lru_cache(maxsize=None)
def samples(step: int) -> dict[int, Sample]:
    """Step ``step``'s samples by id (ids unique over the run): images first, then text;
    labels are the text tokens (the first position of every sample carries none)."""
    cfg = _config()
    generator = torch.Generator().manual_seed(100 + step)
    out = {}
    for n, (images, text) in enumerate(STEPS[step]):
        sample_id = 100 * step + n
        image_tokens = sum(images)
        ids = torch.cat([torch.full((image_tokens,), cfg.image_token_id),
                         torch.randint(0, cfg.image_token_id, (text,), generator=generator)])
        labels = ids.clone()
        labels[:max(image_tokens, 1)] = IGNORE
        rows = MERGE * MERGE * image_tokens
        meta = SampleMeta(sample_id, step, image_tokens + text, image_tokens, tuple(MERGE * MERGE * t for t in images))
        out[sample_id] = Sample(meta, ids, labels, torch.randn(rows, PATCH_ROW, generator=generator),
                                torch.tensor([[1, MERGE, MERGE * t] for t in images], dtype=torch.long).reshape(-1, 3))
    return out


@lru_cache(maxsize=None)
def loss_tokens(step: int) -> int:
    return sum(int((assemble(step, (s,)).next_token_labels() != IGNORE).sum()) for s in samples(step))


def assemble(step: int, sample_ids, loss_tokens_: int | None = None) -> ModelBatch:
    """The samples packed end to end in one row (dense block-diagonal attention)."""
    chosen = [samples(step)[s] for s in sample_ids]
    lengths = torch.tensor([0] + [len(s.input_ids) for s in chosen])
    segments = lengths.cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(len(s.input_ids)) for s in chosen])
    return ModelBatch(
        input_ids=torch.cat([s.input_ids for s in chosen])[None], labels=torch.cat([s.labels for s in chosen])[None],
        position_ids=positions[None], pixel_values=torch.cat([s.pixel_values for s in chosen]),
        image_grid_thw=torch.cat([s.image_grid_thw for s in chosen]).reshape(-1, 3), segments=segments,
        attention="dense", loss_tokens=loss_tokens_ or 1, sample_ids=[str(s) for s in sample_ids],
        padded_tokens=int(segments[-1]))


def grouping(step: int, dp: int, pp: int):
    metas = [s.meta for s in samples(step).values()]
    return group_step(metas, capacity=TOKENS_PER_MICROBATCH, llm_cost=CostModel(linear=1.0, quadratic=0.05),
                      encoder_cost=EncoderCost(linear=1.0), encoder_budget=24.0, encoder_replicas=ENCODERS,
                      dp=dp, pp=pp, microbatches=MICROBATCHES)


def split(pp: int) -> list[int]:
    return [2] if pp == 1 else [1, 1]


def build_stage(pp: int, stage: int):
    from tiny_vlm import StageModule, build_plain_stage

    return StageModule(build_plain_stage(_config(), split(pp), stage))


def build_vit(frozen: bool):
    from tiny_vlm import vit

    return vit(_config(), frozen=frozen)


# --------------------------------------------------------------------------- one process


@lru_cache(maxsize=None)
def reference(pp: int, frozen: bool, steps: int) -> list[tuple[float, dict[str, torch.Tensor]]]:
    """Each step's loss and gradients, one process, the step's samples one at a time (on
    one torch thread, as the ranks run: several threads of tiny ops on a loaded machine only
    spin against each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(pp, frozen, steps)
    finally:
        torch.set_num_threads(threads)


def _reference(pp: int, frozen: bool, steps: int) -> list[tuple[float, dict[str, torch.Tensor]]]:
    vit, stages = build_vit(frozen), [build_stage(pp, s) for s in range(pp)]
    out = []
    for step in range(steps):
        total = 0.0
        for sample_id in samples(step):
            batch = assemble(step, (sample_id,), loss_tokens(step))
            hidden = vit(batch) if batch.image_grid_thw.numel() else None
            for s, stage in enumerate(stages):
                stage.set_input_tensor([hidden])
                hidden = stage(batch)
            share = hidden.sum() / loss_tokens(step)
            share.backward()
            total += float(share.detach())
        out.append((total, _take_grads(vit, stages)))
    return out


def _take_grads(vit, stages: dict | list) -> dict[str, torch.Tensor]:
    """The named gradients (``vit.*``, ``llm<stage>.*``), then zeroed for the next step."""
    named = [] if vit is None else [(f"vit.{n}", p) for n, p in vit.named_parameters()]
    items = stages.items() if isinstance(stages, dict) else enumerate(stages)
    named += [(f"llm{s}.{n}", p) for s, stage in items for n, p in stage.named_parameters()]
    grads = {n: p.grad.clone() for n, p in named if p.grad is not None}
    for _, p in named:
        p.grad = None
    return grads


# --------------------------------------------------------------------------- the flow's ranks


def _flow_rank(rank: int, world_size: int, name: str, scenarios: list[Scenario]) -> dict:
    """Every layout of :data:`LAYOUTS`, every scenario, on this rank (one launch: the ranks'
    start-up is most of the time)."""
    import torch.distributed as dist

    out = {}
    for layout, (pp, dp) in LAYOUTS.items():
        ranks = FlowRanks(ENCODERS, dp, pp)
        encoder_group = dist.new_group(ranks.encoder_ranks)
        stage_groups = [dist.new_group(ranks.stage_peers(s)) for s in range(pp)]
        out[layout] = {sc.name: _run_scenario(rank, ranks, sc, f"{name}-{layout}-{sc.name}", encoder_group,
                                              stage_groups) for sc in scenarios}
    return out


def _run_scenario(rank: int, ranks: FlowRanks, sc: Scenario, pool_name: str, encoder_group, stage_groups) -> dict:
    import torch.distributed as dist

    from mindspeed_flow.flat_grads import all_reduce_flat_grads
    from mindspeed_flow.pool import open_pool

    role = ranks.role(rank)
    groupings = [grouping(step, ranks.dp, ranks.pp) for step in range(sc.steps)]
    owner = {"owner": f"rank{rank}"} if sc.backend == "shm" else {}  # the torch pool names its owner itself
    pool = open_pool(sc.backend, capacity_bytes=sc.capacity, name=pool_name, timeout_s=60, **owner)
    if role.region == "vit":
        out = _produce(pool, role.replica, sc, groupings, encoder_group, all_reduce_flat_grads)
    else:
        out = _consume(pool, ranks, role, sc, groupings, stage_groups[role.stage], all_reduce_flat_grads)
    dist.barrier()  # every gradient collected, every entry taken, before any segment goes
    pool.close()
    return out


def _produce(pool, replica: int, sc: Scenario, groupings, group, all_reduce) -> dict:
    from mindspeed_flow.flow import EmbeddingProducer

    vit = build_vit(sc.frozen)
    grads = []

    def encode(metas):
        return vit(assemble(metas[0].step, [m.sample_id for m in metas]))

    def after_step(_):
        if not sc.frozen:
            all_reduce(vit.named_parameters(), group)
            grads.append(_take_grads(vit, {}))

    producer = EmbeddingProducer(pool, encode, replica=replica, trainable=not sc.frozen,
                                 max_in_flight=sc.max_in_flight)
    stats = producer.run(groupings, after_step)
    return {"stats": stats, "grads": grads}


def _consume(pool, ranks: FlowRanks, role, sc: Scenario, groupings, dp_group, all_reduce) -> dict:
    from mindspeed_flow.flow import EmbeddingConsumer, backbone_plan, stage_feed
    from mindspeed_flow.runtime import Binding, Executor, LossRules
    from mindspeed_flow.train.model import forward_step as model_forward_step

    stage = build_stage(ranks.pp, role.stage)
    first = role.stage == 0
    consumer = EmbeddingConsumer(pool, trainable=not sc.frozen) if first else None
    executor = Executor(role.stage, ranks.pipeline(role.replica))
    seen: list[tuple[int, tuple[int, ...]]] = []  # (step, the microbatch's samples) of each forward
    out: dict = {"losses": [], "grads": [], "seen": seen}

    def forward_step(data_iterator, model):
        item = next(data_iterator)
        seen.append((item.step, item.sample_ids))
        if item.embeddings is not None:
            model.set_input_tensor([item.embeddings])
        return model_forward_step(iter([assemble(item.step, item.sample_ids, loss_tokens(item.step))]), model)

    for g in groupings:
        feed = stage_feed(g, role.replica, consumer)
        if first and sc.hold and g.step == 0:
            feed = _hold_last(feed, len(g.replica_microbatches(role.replica)), pool, groupings[1])
        result = executor.run(backbone_plan(g), forward_step, {("llm", role.stage): Binding(stage, feed)},
                              loss=LossRules(calculate_per_token_loss=True))
        if consumer is not None:
            consumer.finish(g, role.replica)
        all_reduce(stage.named_parameters(), dp_group)
        out["losses"].append(sum(float(d["loss"]) for d in result.forward_data_store))
        out["grads"].append(_take_grads(None, {role.stage: stage}))
    out["stats"] = consumer.stats if consumer is not None else None
    return out


def _hold_last(feed, count: int, pool, next_step):
    """``feed``, but its last microbatch is taken only once every producer's first entry of
    ``next_step`` is in the pool (only a producer running ahead can put it by then)."""
    firsts = [next_step.batches[next_step.replica_batches(e)[0]][0] for e in range(ENCODERS)]
    for k, item in enumerate(feed):
        yield item
        if k == count - 2:
            pool.wait_ready([str(next_step.by_id[s].key("act")) for s in firsts], timeout=60)


# --------------------------------------------------------------------------- the runs

SCENARIOS = [Scenario("trainable", frozen=False), Scenario("frozen", frozen=True, steps=2, hold=True),
             Scenario("pressure", frozen=False, capacity=448, max_in_flight=3),
             Scenario("torch-pool", frozen=False, backend="torch")]
LAYOUTS = {"pp1xdp2": (1, 2), "pp2xdp1": (2, 1)}


@pytest.fixture(scope="module")
def flow_runs():
    from megatron_cpu_harness import launch

    from mindspeed_flow.pool.shm import destroy

    (world_size,) = {ENCODERS + pp * dp for pp, dp in LAYOUTS.values()}  # one launch runs them all
    name = f"flow{os.getpid()}"
    try:
        return launch(_flow_rank, world_size, name, SCENARIOS, timeout_s=300)
    finally:
        destroy(name)


@pytest.fixture(params=list(LAYOUTS))
def flow_run(request, flow_runs):
    pp, dp = LAYOUTS[request.param]
    return pp, dp, [by_layout[request.param] for by_layout in flow_runs]


def _step_results(found: list[dict], ranks: FlowRanks, scenario: str, step: int):
    """The step loss (summed over the replicas' last stages) and every gradient."""
    loss = sum(found[ranks.stage_rank(d, ranks.pp - 1)][scenario]["losses"][step] for d in range(ranks.dp))
    holders = [found[ranks.stage_rank(d, s)][scenario]["grads"][step] for d in range(ranks.dp) for s in range(ranks.pp)]
    holders += [found[e][scenario]["grads"][step] for e in ranks.encoder_ranks if found[e][scenario]["grads"]]
    grads: dict[str, torch.Tensor] = {}
    for mine in holders:
        for n, g in mine.items():  # the replicas of a stage, and of the encoder, hold the same sum
            if n in grads:
                torch.testing.assert_close(g, grads[n], rtol=0, atol=0, msg=f"replicas disagree on {n}")
            grads[n] = g
    return loss, grads


@pytest.mark.parametrize("scenario", [s.name for s in SCENARIOS])
def test_flow_step_equals_one_process(flow_run, scenario):
    pp, dp, found = flow_run
    sc = next(s for s in SCENARIOS if s.name == scenario)
    ranks = FlowRanks(ENCODERS, dp, pp)
    expected = reference(pp, sc.frozen, sc.steps)
    for step, (ref_loss, ref_grads) in enumerate(expected):
        loss, grads = _step_results(found, ranks, scenario, step)
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
        assert set(grads) == set(ref_grads)
        assert any(n.startswith("vit.") for n in grads) is not sc.frozen
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=1e-5, atol=1e-6, msg=f"step {step} {n}")


def test_groupings_differ_and_every_sample_reaches_the_backbone_once(flow_run):
    pp, dp, found = flow_run
    ranks = FlowRanks(ENCODERS, dp, pp)
    for sc in SCENARIOS:
        for step in range(sc.steps):
            g = grouping(step, dp, pp)
            assert len(g.batches) != len(g.microbatches)
            assert sorted(map(len, g.batches)) != sorted(map(len, g.microbatches))
            firsts = [found[ranks.stage_rank(d, 0)][sc.name] for d in range(dp)]
            fed = [s for first in firsts for st, ids in first["seen"] for s in ids if st == step]
            assert sorted(fed) == sorted(samples(step)), (sc.name, step)
            taken = [s for first in firsts for st, s in first["stats"].taken if st == step]
            assert sorted(taken) == sorted(s for s, x in samples(step).items() if x.meta.patches)
            encoded = [b for e in ranks.encoder_ranks for st, b in found[e][sc.name]["stats"].forwards if st == step]
            assert sorted(encoded) == list(range(len(g.batches)))  # each batch once, by its replica
            for e in ranks.encoder_ranks:
                assert [b for st, b in found[e][sc.name]["stats"].forwards if st == step] == g.replica_batches(e)
            if not sc.frozen:
                backwards = [b for e in ranks.encoder_ranks for st, b in found[e][sc.name]["stats"].backwards
                             if st == step]
                assert sorted(backwards) == list(range(len(g.batches)))


def test_back_pressure_producer_puts_more_than_its_pool_holds(flow_run):
    _, _, found = flow_run
    sc = next(s for s in SCENARIOS if s.name == "pressure")
    for e in range(ENCODERS):
        assert found[e]["pressure"]["stats"].bytes_put > sc.capacity  # no eviction, so puts waited for takes
    # equality of that step with one process: test_flow_step_equals_one_process[pressure]


def test_frozen_producer_runs_ahead_into_the_next_step(flow_run):
    """The backbone's step 0 could only finish because every producer put step 1's first
    entries before it (``_hold_last``); each producer encoded every batch of both steps once,
    step 0's before step 1's."""
    pp, dp, found = flow_run
    for e in range(ENCODERS):
        forwards = found[e]["frozen"]["stats"].forwards
        expected = [(step, b) for step in range(2) for b in grouping(step, dp, pp).replica_batches(e)]
        assert forwards == expected
        assert found[e]["frozen"]["stats"].backwards == []
