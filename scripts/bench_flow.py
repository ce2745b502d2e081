"""FlowTrain's flow vs today's lockstep decoupled step vs the ViT in pipeline stage 0, under a
jittery ViT, measured on real processes and predicted by the schedule simulator.

Compute is *injected* time, as in ``scripts/bench_decoupled.py`` (its ``Busy`` sleeps, so the
4 ranks do not share the 2 cores): an image of ``p`` ViT patches costs ``--vit-us`` us per
patch forward, an LLM microbatch ``a*sum(l) + b*sum(l^2)`` (``--llm-us``, ``--llm-quad-ns``),
backwards twice their forward (a frozen ViT none).  Image sizes are drawn from a heavy-tailed
(Pareto) distribution, fresh for every step, the same draws for every layout.  The default
workload is LLM-heavy; ``--vit-us 100`` makes the ViT the larger side (FlowTrain's regime).

Layouts, 4 ranks each:
- ``flow``: the encoder replicas (producers, one pool entry per sample, batches of at most
  ``--encoder-patches`` patches) + the backbone ``--backbone PPxDP`` (default 2x1; the
  encoder gets the other ranks) (``mindspeed_flow.flow`` runtime); a frozen ViT runs ahead
  into the next step (``run_ahead``), as in ``mindspeed-flow train``;
- ``lockstep``: the same ranks as today's decoupled step (``mindspeed_flow.decoupled``):
  in each backbone replica's slice, encoder replica ``m % E`` encodes exactly LLM microbatch ``m``;
- ``stage0-pp2`` (PP=2 x DP=2) and ``stage0-pp1`` (PP=1 x DP=4): the ViT inside stage 0,
  the baseline at its best of the two.
Every layout trains the same LLM microbatches (``group_step``'s, packed by the LLM's cost;
backbone replica ``d`` trains those ``group_step`` dealt to replica ``d``).
The simulator's prediction: ``compose_flow`` + ``simulate`` (trainable flow, per step),
per step the longer of the backbone's step from entries encoded ahead and the producers'
forwards of the next step (frozen flow: the producers run one step ahead, the steps end at a
barrier; :func:`predicted_frozen_flow`), ``DecoupledLayout.plan`` + ``simulate`` per slice
(lockstep), ``compose`` of the ViT-in-stage-0 pipeline + ``simulate`` (stage0-pp2), and the
replicas' summed compute (stage0-pp1, no pipeline).  Pool gets cost a fixed per-transfer
time measured here first (``transfer_overhead``: announce, put, ready, get, release of one
small entry through the ``shm`` pool) plus their bytes; the flow's per sample, lockstep's
per microbatch.  The runtime's own costs are measured here first too (``runtime_costs``: a
2-stage pipeline of one microbatch run by the executor on two ranks): every forward and
backward pays the per-action overhead on top of its injected time (``RegionCost.overhead``),
every stage-to-stage transfer the measured transfer time (``Link.latency``) and each of
its ends the measured time of a send action (``Link.post``).  Each rank
collects and freezes its setup's objects before its first step (``gc.freeze``), every
layout alike, so that no full collection of them lands in a measured step; the collections
left are printed.

    python scripts/bench_flow.py                 # trainable and frozen ViT; PNG + JSON under outputs/bench_flow/
    python scripts/bench_flow.py --vit-us 100 --backbone 1x2 --out outputs/bench_flow_vit
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decoupled import Busy, launch  # noqa: E402 - the same injected compute and launcher

from mindspeed_flow.decoupled import DecoupledLayout  # noqa: E402
from mindspeed_flow.flow import (EmbeddingConsumer, EmbeddingProducer, EncoderCost, FlowRanks,  # noqa: E402
                                 SampleMeta, StepNumbering, backbone_plan, compose_flow, compose_flow_steps, flow_costs,
                                 group_step, stage_feed)
from mindspeed_flow.packing import CostModel  # noqa: E402
from mindspeed_flow.runtime import Binding, Executor, LossRules  # noqa: E402
from mindspeed_flow.schedule import OneFOneB, Region, compose, simulate  # noqa: E402
from mindspeed_flow.schedule.costs import CostTable, Link, RegionCost  # noqa: E402
from mindspeed_flow.schedule.gantt import draw  # noqa: E402

DIM = 16
ROWS = 8
WORLD = 4
LAYOUTS = ("flow", "lockstep", "stage0-pp2", "stage0-pp1")


# ----------------------------------------------------------------------------- workload


def step_samples(args: argparse.Namespace, step: int) -> list[SampleMeta]:
    """One step's samples: heavy-tailed image sizes (Pareto, multiples of 4 patches), a few text-only."""
    g = torch.Generator().manual_seed(args.seed * 1000 + step)
    out = []
    for i in range(args.samples):
        text = int(torch.randint(64, 384, (), generator=g))
        if float(torch.rand((), generator=g)) < 0.1:
            out.append(SampleMeta(i, step, text))
            continue
        pareto = float(torch.rand((), generator=g)) ** (-1.0 / args.alpha)  # >= 1, heavy tail
        patches = 4 * min(int(args.min_patches / 4 * pareto), args.max_patches // 4)
        out.append(SampleMeta(i, step, text + patches // 4, patches // 4, (patches,)))
    return out


def models(args: argparse.Namespace) -> tuple[CostModel, EncoderCost]:
    return (CostModel(linear=args.llm_us * 1e-6, quadratic=args.llm_quad_ns * 1e-9),
            EncoderCost(linear=args.vit_us * 1e-6))


def shape(args: argparse.Namespace) -> tuple[int, int, int]:
    """(encoder replicas, backbone PP, backbone DP) of the flow and lockstep layouts on 4 ranks."""
    pp, dp = (int(x) for x in args.backbone.split("x"))
    encoders = WORLD - pp * dp
    if encoders < 1 or encoders % dp:
        raise SystemExit(f"--backbone {args.backbone}: leaves {encoders} of {WORLD} ranks for the encoder, "
                         f"not a positive multiple of DP={dp} (lockstep: encoder replicas per backbone replica)")
    return encoders, pp, dp


def grouping(args: argparse.Namespace, step: int):
    llm, encoder = models(args)
    encoders, pp, dp = shape(args)
    return group_step(step_samples(args, step), capacity=args.capacity, llm_cost=llm, encoder_cost=encoder,
                      encoder_budget=encoder.cost([SampleMeta(0, 0, 1, 0, (args.encoder_patches,))]),
                      encoder_replicas=encoders, dp=dp, pp=pp, microbatches=args.microbatches)


def decoupled(args: argparse.Namespace) -> DecoupledLayout:
    """Today's lockstep decoupled layout on the same ranks as the flow."""
    encoders, pp, dp = shape(args)
    return DecoupledLayout(encoder_dp=encoders // dp, backbone_pp=pp, backbone_dp=dp, max_ahead=args.microbatches)


def seconds(args: argparse.Namespace, g) -> tuple[list[float], list[float]]:
    """Per LLM microbatch: its samples' ViT forward seconds, and its LLM forward seconds."""
    llm, encoder = models(args)
    return ([encoder.cost(g.metas(m)) for m in g.microbatches],
            [llm.cost([s.llm_tokens for s in g.metas(m)]) for m in g.microbatches])


class Chunk(nn.Module):
    """A model chunk whose forward sleeps ``cost(item)`` (backward twice that, or ``frozen``: none)."""

    def __init__(self, cost, *, reads_input: bool, frozen: bool = False) -> None:
        super().__init__()
        self.layer = nn.Linear(DIM, DIM)
        self.cost, self.reads_input, self.frozen = cost, reads_input, frozen
        self.input: torch.Tensor | None = None
        if frozen:
            self.requires_grad_(False)

    def set_input_tensor(self, tensors: list) -> None:
        self.input = tensors[0]

    def forward(self, item: Any) -> torch.Tensor:
        x = self.input if self.reads_input and self.input is not None else torch.ones(ROWS, DIM)
        if x.shape[0] != ROWS:  # a microbatch's image embeddings, summed into the rows
            x = x.sum(0, keepdim=True).expand(ROWS, DIM) / max(1, x.shape[0])
        f = self.cost(item)
        out = torch.tanh(self.layer(x))
        if self.frozen:
            time.sleep(f)
            return out
        return Busy.apply(out, f, 2 * f)


def forward_step(data_iterator, model):
    def loss_func(output):
        loss = output.pow(2).mean()
        return loss, {"loss": loss.detach()}

    return model(next(data_iterator)), loss_func


# ----------------------------------------------------------------------------- ranks


def worker(rank: int, world: int, args: argparse.Namespace, layout: str, frozen: bool,
           name: str) -> tuple[list[float], list[float]]:
    """Step times on this rank (barrier to barrier), ``args.steps + 1`` steps (the first warms
    up), and the seconds of each garbage collection during the measured steps.

    Every layout's rank collects and freezes what its setup built (``gc.freeze``: imports,
    models, pools) before its first step, as Megatron's ``--manual-gc`` keeps collections
    out of the step: otherwise a full (generation 2) collection walks all of it, 50-80 ms,
    and it fell on the flow's first measured step in session 13's traces.  Collections of a
    step's own garbage still run, and are counted."""
    import gc

    import torch.distributed as dist

    groupings = [grouping(args, step) for step in range(args.steps + 2)]
    run = {"flow": _flow_rank, "lockstep": _lockstep_rank, "stage0-pp2": _stage0_rank,
           "stage0-pp1": _stage0_rank}[layout]
    state = run(rank, args, layout, frozen, name, groupings)
    gc.collect()
    gc.freeze()
    pauses: list[float] = []
    started: list[float] = []

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[:] = [time.perf_counter()]
        elif started:
            pauses.append(time.perf_counter() - started[0])

    times = []
    for step in range(args.steps + 1):
        dist.barrier()
        if step == 1:
            gc.callbacks.append(timed)
        start = time.monotonic()
        state(step)
        dist.barrier()
        times.append(time.monotonic() - start)
    gc.callbacks.remove(timed)
    closer = getattr(state, "close", None)
    if closer is not None:
        closer()
    return times, pauses


def _flow_rank(rank, args, layout, frozen, name, groupings):
    import torch.distributed as dist

    from mindspeed_flow.pool import open_pool

    encoders, pp, dp = shape(args)
    ranks = FlowRanks(encoders, dp, pp)
    region, replica, stage = ranks.role(rank)
    pipelines = [dist.new_group(ranks.pipeline(d)) for d in range(dp)]
    pool = open_pool("shm", capacity_bytes=args.pool_mb << 20, name=name, owner=f"rank{rank}", timeout_s=120)
    llm, encoder = models(args)
    dist.barrier()
    if region == "vit":
        vit = Chunk(lambda metas: encoder.cost(metas), reads_input=False, frozen=frozen)

        def encode(metas):
            out = vit(metas)  # [ROWS, DIM], its sleep the batch's cost
            rows = sum(m.image_tokens for m in metas)
            return out.mean(0, keepdim=True).expand(rows, DIM).contiguous()

        producer = EmbeddingProducer(pool, encode, replica=replica, trainable=not frozen, timeout_s=120)

        def step(k):
            producer.forward(groupings[k])
            if not frozen:
                producer.backward(groupings[k])
            elif k < args.steps:
                producer.run_ahead(groupings[k + 1])

        def close():
            producer.wait_taken()
            dist.barrier()
            pool.close()
    else:
        chunk = Chunk(lambda item: llm.cost([s.llm_tokens for s in groupings[item.step].metas(item.sample_ids)]) / pp,
                      reads_input=True)
        consumer = EmbeddingConsumer(pool, trainable=not frozen, timeout_s=120) if stage == 0 else None
        executor = Executor(stage, ranks.pipeline(replica), group=pipelines[replica])

        def flow_forward_step(data_iterator, model):
            item = next(data_iterator)
            if stage == 0:
                model.set_input_tensor([item.embeddings])
            return forward_step(iter([item]), model)

        def step(k):
            g = groupings[k]
            executor.run(backbone_plan(g), flow_forward_step,
                         {("llm", stage): Binding(chunk, stage_feed(g, replica, consumer))},
                         loss=LossRules(calculate_per_token_loss=True))
            if consumer is not None:
                consumer.finish(g, replica)

        def close():
            dist.barrier()
            pool.close()
    step.close = close
    return step


def _lockstep_rank(rank, args, layout, frozen, name, groupings):
    import torch.distributed as dist

    from mindspeed_flow.pool import open_pool

    layout = decoupled(args)
    role = layout.role(rank)
    slices = [dist.new_group(layout.slice_ranks(d)) for d in range(layout.backbone_dp)]
    replica = layout.replica(rank)
    pool = open_pool("shm", capacity_bytes=args.pool_mb << 20, name=f"{name}-{replica}", owner=f"rank{rank}",
                     timeout_s=120)
    ranks = layout.executor_ranks(rank)
    executor = Executor(ranks.index(rank), ranks, group=slices[replica], pool=pool)
    share = args.microbatches // layout.backbone_dp
    mine = [m for m in range(args.microbatches) if m % layout.backbone_dp == replica]  # the flow's replica's
    current = {}
    vit_s = lambda m: current["vit"][m]  # noqa: E731
    llm_s = lambda m: current["llm"][m] / layout.backbone_pp  # noqa: E731
    module = (Chunk(vit_s, reads_input=False, frozen=frozen) if role.region == "vit"
              else Chunk(llm_s, reads_input=True))
    plan = layout.plan(share, trainable_encoder=not frozen)
    dist.barrier()

    def step(k):
        vit, llm = seconds(args, groupings[k])
        current["vit"], current["llm"] = [vit[m] for m in mine], [llm[m] for m in mine]
        executor.run(plan, forward_step, {role.binding: Binding(module, iter(range(share)))})

    def close():
        dist.barrier()
        pool.close()
    step.close = close
    return step


def _stage0_rank(rank, args, layout, frozen, name, groupings):
    import torch.distributed as dist

    pp = 2 if layout == "stage0-pp2" else 1
    dp = 4 // pp
    replica, stage = divmod(rank, pp)
    current = {}
    vit = Chunk(lambda m: current["vit"][m], reads_input=False, frozen=frozen)
    llm = Chunk(lambda m: current["llm"][m] / pp, reads_input=True)
    pipelines = [dist.new_group([d * pp + s for s in range(pp)]) for d in range(dp)]
    mine = [m for m in range(args.microbatches) if m % dp == replica]

    class Stage0(nn.Module):  # the ViT inside the first stage
        def set_input_tensor(self, tensors):
            llm.set_input_tensor(tensors)

        def forward(self, m):
            llm.input = vit(m)
            return llm(m)

    model = Stage0() if stage == 0 else llm
    if pp == 2:
        plan = compose([Region("llm", 2, OneFOneB(stages=2))], len(mine))
        executor = Executor(stage, [replica * pp + s for s in range(pp)], group=pipelines[replica])

    def step(k):
        current["vit"], current["llm"] = seconds(args, groupings[k])
        if pp == 2:
            executor.run(plan, forward_step, {("llm", stage): Binding(model, iter(mine))})
            return
        for m in mine:
            out = model(m)
            out.pow(2).mean().backward()

    return step


# ----------------------------------------------------------------------------- the simulator


def region_costs(args: argparse.Namespace, frozen: bool) -> tuple[RegionCost, RegionCost]:
    """The ViT's and the LLM's costs per unit of the per-microbatch seconds (``forward=1``,
    scaled by each group's cost), both ``[ROWS, DIM]`` fp32 activations, every compute action
    paying the runtime's per-action overhead that :func:`runtime_costs` measured."""
    vit = RegionCost(forward=1.0, backward_ratio=2.0, input_grad_ratio=0.0 if frozen else 1.0,
                     output_bytes=ROWS * DIM * 4, overhead=args.action_s)
    return vit, RegionCost(forward=1.0, backward_ratio=2.0, output_bytes=ROWS * DIM * 4, overhead=args.action_s)


def links(args: argparse.Namespace) -> tuple[Link, Link]:
    """The stage-to-stage link (a transfer's latency and each end's own part,
    :func:`runtime_costs`) and the pool's (one transfer's fixed cost,
    :func:`transfer_overhead`); bytes are free on one host."""
    return Link(latency=args.link_s, post=args.post_s), Link(latency=args.transfer_s)


def predicted(args: argparse.Namespace, layout: str, frozen: bool, step: int) -> float:
    """The simulator's step time of ``step`` (a frozen flow: see :func:`predicted_frozen_flow`)."""
    g = grouping(args, step)
    llm, encoder = models(args)
    vit_f, llm_f = seconds(args, g)
    vit_cost, llm_cost = region_costs(args, frozen)
    link, pool = links(args)
    if layout == "flow":
        plan = compose_flow(g, trainable_encoder=not frozen)
        return simulate(plan, flow_costs(g, llm_cost=llm, encoder_cost=encoder, encoder=vit_cost,
                                         backbone=llm_cost, link=link, pool=pool, token_bytes=DIM * 4)).step_time
    table = CostTable({"vit": vit_cost, "llm": llm_cost}, link=link, pool=pool,
                      microbatch_scale=lambda region, m: vit_f[m] if region == "vit" else llm_f[m])
    if layout == "lockstep":  # each backbone replica's slice: the flow's replica's microbatches
        lockstep = decoupled(args)
        dp = lockstep.backbone_dp
        times = []
        for d in range(dp):
            mine = [m for m in range(args.microbatches) if m % dp == d]
            local = CostTable(table.regions, link=link, pool=pool, microbatch_scale=lambda region, m, mine=mine:
                              vit_f[mine[m]] if region == "vit" else llm_f[mine[m]])
            times.append(simulate(lockstep.plan(len(mine), trainable_encoder=not frozen), local).step_time)
        return max(times)
    vit_b = 0.0 if frozen else 2.0
    if layout == "stage0-pp1":  # no executor: a forward and a backward per microbatch, each paying the overhead
        return max(sum(vit_f[m] * (1 + vit_b) + 3 * llm_f[m] + 2 * args.action_s
                       for m in range(args.microbatches) if m % 4 == d) for d in range(4))
    times = []
    for d in range(2):
        mine = [m for m in range(args.microbatches) if m % 2 == d]
        sk = OneFOneB(stages=2)
        plan = compose([Region("vit", 1, sk, trainable=not frozen), Region("llm", 2, sk)], len(mine))
        local = CostTable(table.regions, link=link, microbatch_scale=lambda region, m, mine=mine:
                          vit_f[mine[m]] if region == "vit" else llm_f[mine[m]])
        times.append(simulate(plan, local).step_time)
    return max(times)


# ----------------------------------------------------------------------------- main


def predicted_frozen_flow(args: argparse.Namespace, path: Path | None = None) -> float:
    """A frozen flow's mean measured-step time as the simulator sees it.

    The bench's steps meet at a barrier (as a trainer's steps end together) and a frozen
    producer runs one step ahead (:meth:`~mindspeed_flow.flow.EmbeddingProducer.run_ahead`
    of the next step, whose entries all fit the pool): in measured step ``k`` the backbone
    trains step ``k`` from entries encoded in step ``k - 1`` while the producers encode step
    ``k + 1`` (nothing after the last step).  So each step takes the longer of the backbone's
    simulated step (``compose_flow`` with the encoder's forwards free: its entries are in)
    and the busiest producer's simulated forwards of the next step.  (``compose_flow_steps``
    alone lets the producers run as far ahead as they can: no step boundary, so a heavy
    step's images spread into the earlier steps' slack, which the measured run cannot do.)
    ``path``: the Gantt chart of the whole run as ``compose_flow_steps`` (no boundary)."""
    llm, encoder = models(args)
    groupings = [grouping(args, step) for step in range(args.steps + 1)]
    vit_cost, llm_cost = region_costs(args, frozen=True)
    link, pool = links(args)
    encoded = replace(vit_cost, overhead=0.0)  # forwards the previous step ran: nothing to pay in this one

    def run(plan, steps, encoder_cost, encoder_region=vit_cost):
        return simulate(plan, flow_costs(steps, llm_cost=llm, encoder_cost=encoder_cost, encoder=encoder_region,
                                         backbone=llm_cost, link=link, pool=pool, token_bytes=DIM * 4))

    if path is not None:
        whole = run(compose_flow_steps(groupings, trainable_encoder=False), groupings, encoder)
        draw(whole, path, title="frozen flow, simulated without step boundaries (step:group)",
             text=StepNumbering.of(groupings).label)
    times = []
    for k in range(1, args.steps + 1):
        g = groupings[k]
        backbone = run(compose_flow(g, trainable_encoder=False), g, EncoderCost(), encoded).step_time
        ahead = 0.0
        if k < args.steps:
            following = grouping(args, k + 1)
            result = run(compose_flow(following, trainable_encoder=False), following, encoder)
            ahead = max(result.busy[e] for e in range(following.encoder_replicas))
        times.append(max(backbone, ahead))
    return statistics.mean(times)


def transfer_overhead(args: argparse.Namespace, count: int = 300) -> float:
    """Seconds of one sample's way through the ``shm`` pool besides its bytes (announce,
    put, ready, handle, get, release of a ``[1, DIM]`` entry with a sample's metadata), the
    mean over ``count`` in this process: the simulator's fixed per-transfer cost."""
    from mindspeed_flow.pool import open_pool
    from mindspeed_flow.pool.shm import destroy

    name = f"bflow{os.getpid()}-overhead"
    pool = open_pool("shm", capacity_bytes=1 << 20, name=name, owner="rank0")
    meta = SampleMeta(0, 0, 8, 1, (4,))
    row = torch.ones(1, DIM)
    try:
        start = time.perf_counter()
        for i in range(count):
            key = f"flow/step0/act/{i}"
            pool.announce([key])
            pool.put(key, row, meta.to_pool_meta(), timeout=1)
            if pool.ready(key):
                pool.get(pool.handle(key, timeout=0))
                pool.release(key)
        return (time.perf_counter() - start) / count
    finally:
        pool.close()
        destroy(name)


PROBE_S = 2e-3  # the probe's injected forward seconds (backward twice that)
PROBE_STEPS = 40


def _runtime_probe(rank: int, world: int) -> list[tuple[float, float, float, float, float]]:
    """Rank ``rank`` of a 2-stage pipeline of one microbatch (``F s0 -> F s1, B s1 -> B s0``)
    run by the executor with the bench's :class:`Chunk`: per measured step, this rank's
    forward and backward stamps' (start, end) and its send's seconds, as ``(f_start, f_end,
    b_start, b_end, send_s)``."""
    import torch.distributed as dist

    chunk = Chunk(lambda item: PROBE_S, reads_input=True)
    plan = compose([Region("llm", 2, OneFOneB(stages=2))], 1)
    executor = Executor(rank, [0, 1])
    out = []
    for step in range(PROBE_STEPS + 1):
        dist.barrier()
        stamps = executor.run(plan, forward_step, {("llm", rank): Binding(chunk, iter([0]))}).timeline.stamps
        forward, backward = (next(s for s in stamps if s.action.kind.value == kind) for kind in ("F", "B"))
        send = next(s for s in stamps if s.action.kind.value.startswith("SEND"))
        if step:  # the first step warms up
            out.append((forward.start, forward.end, backward.start, backward.end, send.end - send.start))
    return out


def runtime_costs() -> tuple[float, float, float]:
    """The runtime's costs that the injected compute leaves out, measured here first on two
    ranks of a 2-stage pipeline (the executor, the bench's :class:`Chunk`, gloo on
    loopback), medians over the probe's steps (both ranks read the same monotonic clock):

    - a forward or backward action's seconds beyond its injected time (the executor's
      per-action work, the forward step and loss, autograd, the sleep's overshoot): the
      simulator's ``RegionCost.overhead`` of every compute;
    - a send action's seconds (an eager send never waits for its peer: the rank's own part
      of a transfer, taken for a receive's part too): ``Link.post``;
    - one stage-to-stage transfer, from the end of the sender's compute to the start of the
      receiver's (which waits for it), less the receive's part: ``Link.latency``.

    Returns ``(overhead, latency, post)``."""
    first, last = launch(_runtime_probe, 2, timeout_s=120)
    excess, transfer, post = [], [], []
    for (f0, f0_end, b0, b0_end, send0), (f1, f1_end, b1, b1_end, send1) in zip(first, last):
        excess += [f0_end - f0 - PROBE_S, f1_end - f1 - PROBE_S, b1_end - b1 - 2 * PROBE_S, b0_end - b0 - 2 * PROBE_S]
        transfer += [f1 - f0_end, b0 - b1_end]
        post += [send0, send1]
    own = statistics.median(post)
    return statistics.median(excess), max(0.0, statistics.median(transfer) - own), own


def measure(args: argparse.Namespace, frozen: bool) -> dict:
    rows = {}
    for layout in LAYOUTS:
        name = f"bflow{os.getpid()}-{layout}-{int(frozen)}"
        ranks = launch(worker, WORLD, args, layout, frozen, name, timeout_s=600)
        per_step = [max(r[0][k] for r in ranks) for k in range(1, args.steps + 1)]  # slowest rank, warm-up left out
        gc_s = max(sum(r[1]) for r in ranks)  # the rank that spent most in collections, measured steps
        if layout == "flow" and frozen:
            simulated = predicted_frozen_flow(args, args.out / "sim_frozen_flow.png")
        else:
            simulated = statistics.mean(predicted(args, layout, frozen, k) for k in range(1, args.steps + 1))
        rows[layout] = {"step_s": statistics.mean(per_step), "steps_s": per_step, "simulated_s": simulated,
                        "gc_s": gc_s}
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The bench's options (its workload, layouts and output)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=24, help="samples per step")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--capacity", type=int, default=2048, help="LLM tokens per microbatch at most")
    parser.add_argument("--encoder-patches", type=int, default=1024, help="patches per encoder batch at most")
    parser.add_argument("--min-patches", type=int, default=64, help="the Pareto draw's scale")
    parser.add_argument("--max-patches", type=int, default=2048)
    parser.add_argument("--alpha", type=float, default=1.2, help="Pareto tail index (smaller: heavier)")
    parser.add_argument("--vit-us", type=float, default=40.0, help="ViT forward us per patch")
    parser.add_argument("--llm-us", type=float, default=20.0, help="LLM forward us per token")
    parser.add_argument("--llm-quad-ns", type=float, default=5.0, help="LLM forward ns per token^2 of a sample")
    parser.add_argument("--steps", type=int, default=4, help="measured steps (after one warm-up step)")
    parser.add_argument("--pool-mb", type=int, default=16)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--backbone", default="2x1", help="the flow's and lockstep's backbone PPxDP (the encoder "
                        f"gets the other of the {WORLD} ranks)")
    parser.add_argument("--vit", choices=("both", "trainable", "frozen"), default="both")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_flow"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from mindspeed_flow.pool.shm import destroy

    results = {}
    args.transfer_s = transfer_overhead(args)
    args.action_s, args.link_s, args.post_s = runtime_costs()
    print(f"load: {os.getloadavg()}; one pool transfer's fixed cost: {args.transfer_s * 1e6:.0f} us; "
          f"the runtime's per-action overhead {args.action_s * 1e6:.0f} us, stage-to-stage transfer "
          f"{args.link_s * 1e6:.0f} us + {args.post_s * 1e6:.0f} us at each end; "
          f"flow/lockstep: {shape(args)[0]} encoder ranks + backbone PP={shape(args)[1]} x DP={shape(args)[2]}")
    try:
        for frozen in {"both": (False, True), "trainable": (False,), "frozen": (True,)}[args.vit]:
            label = "frozen ViT" if frozen else "trainable ViT"
            rows = measure(args, frozen)
            base = min(rows["stage0-pp2"]["step_s"], rows["stage0-pp1"]["step_s"])
            print(f"\n{label}: step time (mean of {args.steps} measured steps, slowest rank), simulator, ratios, "
                  "garbage collection in the measured steps (the rank with the most)")
            print(f"{'layout':<11} {'step s':>8} {'simulated s':>12} {'sim/meas':>9} {'lockstep/this':>14} "
                  f"{'best stage0/this':>17} {'gc ms':>6}")
            for layout, row in rows.items():
                row["sim_over_measured"] = row["simulated_s"] / row["step_s"]
                row["speedup_vs_lockstep"] = rows["lockstep"]["step_s"] / row["step_s"]
                row["speedup_vs_best_stage0"] = base / row["step_s"]
                print(f"{layout:<11} {row['step_s']:>8.3f} {row['simulated_s']:>12.3f} {row['sim_over_measured']:>9.2f} "
                      f"{row['speedup_vs_lockstep']:>13.2f}x {row['speedup_vs_best_stage0']:>16.2f}x "
                      f"{row['gc_s'] * 1e3:>6.1f}")
            results[label] = rows
    finally:
        destroy(f"bflow{os.getpid()}")  # every pool of this run: the name is a prefix
    (args.out / "bench_flow.json").write_text(json.dumps({"config": {k: str(v) if isinstance(v, Path) else v
                                                                     for k, v in vars(args).items()},
                                                          "results": results}, indent=1))
    _chart(results, args.out / "bench_flow.png")
    print(f"\nwritten: {args.out}/bench_flow.json, bench_flow.png")
    return 0


def _chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.6), squeeze=False)
    for ax, (label, rows) in zip(axes[0], results.items()):
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["step_s"] for r in rows.values()], width=0.4, label="measured")
        ax.bar([x + 0.2 for x in xs], [r["simulated_s"] for r in rows.values()], width=0.4, label="simulated")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(list(rows), fontsize=8)
        ax.set_ylabel("step seconds")
        ax.set_title(label)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
