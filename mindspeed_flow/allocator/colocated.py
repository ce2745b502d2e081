"""Co-located candidates: the whole model under one strategy, Megatron / MindSpeed-MM
style, with the ViT inside pipeline stage 0 of the LLM's 1F1B.

Every device runs the same TP; the stages hold ``[ViT + k LLM layers, n, ..., n, last]``
with ``k`` chosen per config to balance stage 0 against the others by their per-layer
times (the split MindSpeed-MM users tune by hand, like 72B's ``[6, 11, ..., 8]``) within
what each stage's memory holds, and the other stages equal except the last, so that
Megatron's first/last-stage flags can say it.  The
encoder produces exactly what the backbone consumes (one pipeline does both), so such a
candidate has no mismatch.  They are the ``megatron-uniform`` baseline of the benchmark
and, with ``"colocated"`` in ``Workload.placements``, candidates of the MILP.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from mindspeed_flow.schedule.regions import ENCODER_REGION

from . import memory
from .candidates import LazyPool, Rejection, divisors
from .memory import MemoryEstimate
from .pipeline import HEAD_REGION, LAYERS_REGION, PipelineLayout, pipeline_step, planned_live, step_lower_bound
from .proxy import ProxyModel
from .specs import ClusterSpec, ModelSpec, Workload

VIT_REGION = ENCODER_REGION


@lru_cache(maxsize=4096)  # replica counts of one shape often share their caps
def colocated_split(vit_forward: float, layer_forward: float, layers: int, vit_layers: int, stages: int,
                    caps: tuple[int, int, int] | None = None) -> tuple[int, ...] | None:
    """Layers per stage, counted over ViT + LLM as MindSpeed-MM's ``pipeline_num_layers``
    lists add up: stage 0 = ViT + ``k`` LLM layers, the middle stages ``per`` each and the
    last what remains (at least one).  ``caps`` bounds the LLM layers of stage 0, of each
    middle stage and of the last stage (what fits their memory, :func:`layer_caps`); among
    the splits within them, the one with the fastest slowest stage (forward), ties to the
    smaller ``k``, then to the more even rest (ceil over floor), so that without caps the
    rest is ``ceil(rest / (stages - 1))`` per middle stage as before.  None when no split
    fits the caps."""
    cap0, cap_mid, cap_last = caps or (layers, layers, layers)
    if stages == 1:
        return (vit_layers + layers,) if layers <= min(cap0, cap_last) else None
    middle = stages - 2
    best: tuple[float, tuple[int, ...]] | None = None
    for k in range(0, min(cap0, layers - stages + 1) + 1):
        rest = layers - k
        low = max(1, -(-(rest - cap_last) // middle)) if middle else 0
        high = min(cap_mid, (rest - 1) // middle) if middle else 0
        if low > high or (middle == 0 and not 1 <= rest <= cap_last):
            continue
        # max(per, last) is convex in per: its integer minimum is next to rest / (stages - 1).
        pers = {min(max(q, low), high) for q in (rest // (middle + 1), -(-rest // (middle + 1)))}
        per = min(pers, key=lambda q: (max(q, rest - middle * q), -q))
        slowest = max(vit_forward + k * layer_forward, max(per, rest - middle * per) * layer_forward)
        if best is None or slowest < best[0]:
            best = (slowest, (vit_layers + k,) + (per,) * middle + (rest - middle * per,))
    return None if best is None else best[1]


@dataclass(frozen=True)
class PendingColocated:
    """A co-located config that passed the cheap checks, with its rate's upper bound."""

    tp: int
    pp: int
    micro_batch: int
    dp: int
    split: tuple[int, ...]
    reduce: float  # gradient reduce seconds of stage 0
    bound: float

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def reach(self) -> float:
        """The most a plan with it can do: its own rate bound (it needs no partner)."""
        return self.bound


@dataclass(frozen=True)
class ColocatedEstimate:
    """Predicted performance of a co-located config."""

    tp: int
    pp: int
    micro_batch: int
    dp: int
    split: tuple[int, ...]  # ViT + LLM layers per stage
    llm_split: tuple[int, ...]  # LLM layers per stage
    microbatches: int
    step_time: float
    bubble_fraction: float
    rate: float
    memory: MemoryEstimate

    @property
    def devices(self) -> int:
        return self.tp * self.pp * self.dp


def stage_memory(model: ModelSpec, workload: Workload, tp: int, dp: int, mbs: int, stage: int, stages: int,
                 llm_layers: int, live: int) -> MemoryEstimate:
    """One co-located stage: stage 0 holds the ViT and the embedding besides its LLM layers."""
    enc, bb = model.encoder, model.backbone
    opt = workload.distributed_optimizer
    llm = memory.stage_memory(bb, layers=llm_layers, tp=tp, dp=dp, samples=mbs, live=live, first=stage == 0,
                              last=stage == stages - 1, distributed_optimizer=opt)
    if stage:
        return llm
    vit = memory.stage_memory(enc, layers=enc.layers, tp=tp, dp=dp, samples=mbs, live=live if enc.trainable else 0,
                              first=False, last=False, distributed_optimizer=opt)
    return MemoryEstimate(llm.states + vit.states, llm.activations + vit.activations)


def colocated_memory(model: ModelSpec, workload: Workload, tp: int, dp: int, mbs: int, split: tuple[int, ...],
                     live: tuple[int, ...]) -> MemoryEstimate:
    """The fullest stage of ``split`` (ViT + LLM layers per stage); ``dp`` and ``live`` may
    be numpy arrays over replica counts (see :func:`.memory.stage_memory`)."""
    llm_split = (split[0] - model.encoder.layers,) + split[1:]
    return memory.fullest([stage_memory(model, workload, tp, dp, mbs, s, len(split), count, live[s])
                           for s, count in enumerate(llm_split)])


def layer_caps(model: ModelSpec, workload: Workload, limit: float, tp: int, dp: int | np.ndarray, mbs: int,
               stages: int, microbatches: int | np.ndarray) -> tuple:
    """The most LLM layers stage 0, a middle stage and the last stage can each hold within
    ``limit`` with :func:`planned_live` in flight (a middle stage's cap is stage 1's, the
    fullest of them).  Memory grows linearly with the layers, so each cap is read off two
    estimates, then checked; negative when not even the stage's fixed part fits.  With numpy
    arrays of replica counts ``dp`` and their ``microbatches`` every count is computed at
    once (the co-located pool's inner loop) and each cap is an array; with ints, ints."""
    live = planned_live(stages, microbatches)
    layers = model.backbone.layers

    def total(stage: int, n: int | np.ndarray) -> float | np.ndarray:
        return stage_memory(model, workload, tp, dp, mbs, stage, stages, n, live[stage]).total

    def cap(stage: int) -> np.ndarray:
        base = np.asarray(total(stage, 0))
        per_layer = np.asarray(total(stage, 1)) - base
        positive = per_layer > 0
        n = np.where(positive, (limit - base) // np.where(positive, per_layer, 1), layers).astype(np.int64)
        over = (n >= 0) & (total(stage, n) > limit)
        while over.any():  # rounding of the division
            n = n - over
            over = (n >= 0) & (total(stage, n) > limit)
        return np.minimum(n, layers)

    caps = (cap(0), cap(min(1, stages - 1)), cap(stages - 1))
    return caps if np.ndim(dp) else tuple(int(c) for c in caps)


def _layout(model: ModelSpec, split: tuple[int, ...]) -> PipelineLayout:
    enc, bb = model.encoder, model.backbone
    return PipelineLayout(((VIT_REGION, enc.layers, enc.trainable), (LAYERS_REGION, bb.layers, True),
                           (HEAD_REGION, 1, True)), split[:-1] + (split[-1] + 1,))


def colocated_pool(model: ModelSpec, cluster: ClusterSpec, workload: Workload, proxy: ProxyModel,
                   rejections: list[Rejection]) -> LazyPool:
    """Every co-located config the constraints allow, none simulated yet."""
    enc, bb = model.encoder, model.backbone
    node = cluster.devices_per_node
    pending = []
    for tp in workload.tp_choices:
        if node % tp or any(s.heads % tp or s.query_groups % tp for s in (enc, bb)):
            continue  # the decoupled candidates record these rejections
        for pp in workload.pp_choices or tuple(divisors(bb.layers)):
            if pp > bb.layers:
                continue
            if tp * pp > cluster.devices:
                rejections.append(Rejection("colocated", f"tp {tp} pp {pp}", "devices", tp * pp, cluster.devices,
                                            "devices"))
                continue
            for mbs in workload.micro_batch_choices:
                if workload.global_batch % mbs:
                    continue
                vit = proxy.region_cost("encoder", enc, tp, mbs, enc.layers)
                costs = (vit,) + proxy.backbone_costs(bb, tp, mbs)
                layer_forward = costs[1].forward / bb.layers
                balanced = colocated_split(vit.forward, layer_forward, bb.layers, enc.layers, pp)
                dps = np.array([d for d in divisors(workload.global_batch // mbs) if tp * pp * d <= cluster.devices])
                if not len(dps):
                    continue
                all_caps = layer_caps(model, workload, cluster.memory_limit, tp, dps, mbs, pp,
                                      workload.global_batch // (dps * mbs))
                # what the time-balanced split would need, for the configs no split fits
                needed = colocated_memory(model, workload, tp, dps, mbs, balanced,
                                          planned_live(pp, workload.global_batch // (dps * mbs))).total
                for i, dp in enumerate(dps.tolist()):
                    microbatches = workload.global_batch // (dp * mbs)
                    caps = tuple(int(c[i]) for c in all_caps)
                    split = colocated_split(vit.forward, layer_forward, bb.layers, enc.layers, pp, caps)
                    if split is None:
                        rejections.append(Rejection("colocated", f"tp {tp} pp {pp} mbs {mbs} dp {dp}", "memory",
                                                    float(needed[i]), cluster.memory_limit, "GiB"))
                        continue
                    stage0 = enc.params + (split[0] - enc.layers) * bb.layer_params + bb.vocab * bb.hidden
                    reduce = proxy.gradient_reduce_seconds(stage0, tp, dp)
                    shortest = step_lower_bound(_layout(model, split), costs, microbatches)
                    pending.append(PendingColocated(tp, pp, mbs, dp, split, reduce,
                                                    workload.global_batch / (shortest + reduce)))

    def evaluate(p: PendingColocated) -> ColocatedEstimate | None:
        microbatches = workload.global_batch // (p.dp * p.micro_batch)
        costs = (proxy.region_cost("encoder", enc, p.tp, p.micro_batch, enc.layers),) + \
            proxy.backbone_costs(bb, p.tp, p.micro_batch)
        sim = pipeline_step(_layout(model, p.split), microbatches, costs, proxy.stage_link(p.tp, p.pp))
        mem = colocated_memory(model, workload, p.tp, p.dp, p.micro_batch, p.split, sim.peak_live)
        if mem.total > cluster.memory_limit:
            rejections.append(Rejection("colocated", f"tp {p.tp} pp {p.pp} mbs {p.micro_batch} dp {p.dp}",
                                        "memory", mem.total, cluster.memory_limit, "GiB"))
            return None
        step = sim.step_time + p.reduce
        llm_split = (p.split[0] - enc.layers,) + p.split[1:]
        return ColocatedEstimate(p.tp, p.pp, p.micro_batch, p.dp, p.split, llm_split, microbatches, step,
                                 sim.bubble_fraction, workload.global_batch / step, mem)

    return LazyPool(pending, evaluate)
