"""Co-located candidates: the whole model under one strategy, Megatron / MindSpeed-MM
style, with the ViT inside pipeline stage 0 of the LLM's 1F1B.

Every device runs the same TP; the stages hold ``[ViT + k LLM layers, n, ..., n, last]``
with ``k`` chosen per shape to balance stage 0 against the others by their per-layer times
(the split MindSpeed-MM users tune by hand, like 72B's ``[6, 11, ..., 8]``), and the other
stages equal except the last, so that Megatron's first/last-stage flags can say it.  The
encoder produces exactly what the backbone consumes (one pipeline does both), so such a
candidate has no mismatch.  They are the ``megatron-uniform`` baseline of the benchmark
and, with ``"colocated"`` in ``Workload.placements``, candidates of the MILP.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import memory
from .candidates import LazyPool, Rejection, divisors
from .memory import MemoryEstimate
from .pipeline import HEAD_REGION, LAYERS_REGION, PipelineLayout, pipeline_step, step_lower_bound
from .proxy import ProxyModel
from .specs import ClusterSpec, ModelSpec, Workload

VIT_REGION = "vit"


def colocated_split(vit_forward: float, layer_forward: float, layers: int, vit_layers: int,
                    stages: int) -> tuple[int, ...]:
    """Layers per stage, counted over ViT + LLM as MindSpeed-MM's ``pipeline_num_layers``
    lists add up: stage 0 = ViT + ``k`` LLM layers, the middle stages ``ceil(rest / (stages
    - 1))`` each and the last what remains, ``k`` minimising the slowest stage's forward."""
    if stages == 1:
        return (vit_layers + layers,)

    def rest_split(k: int) -> tuple[int, ...]:
        rest = layers - k
        per = -(-rest // (stages - 1))
        if rest - per * (stages - 2) < 1:
            per = rest // (stages - 1)
        return (per,) * (stages - 2) + (rest - per * (stages - 2),)

    def slowest(k: int) -> float:
        return max(vit_forward + k * layer_forward, max(rest_split(k)) * layer_forward)

    k = min(range(0, layers - stages + 2), key=slowest)
    return (vit_layers + k,) + rest_split(k)


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


def colocated_memory(model: ModelSpec, workload: Workload, tp: int, dp: int, mbs: int, split: tuple[int, ...],
                     live: tuple[int, ...]) -> MemoryEstimate:
    """The fullest stage: stage 0 holds the ViT and the embedding besides its LLM layers."""
    enc, bb = model.encoder, model.backbone
    opt = workload.distributed_optimizer
    worst = MemoryEstimate(0.0, 0.0)
    for s, count in enumerate(split):
        vit_layers = enc.layers if s == 0 else 0
        llm = memory.stage_memory(bb, layers=count - vit_layers, tp=tp, dp=dp, samples=mbs, live=live[s],
                                  first=s == 0, last=s == len(split) - 1, distributed_optimizer=opt)
        vit = memory.stage_memory(enc, layers=vit_layers, tp=tp, dp=dp, samples=mbs,
                                  live=live[s] if enc.trainable else 0, first=False, last=False,
                                  distributed_optimizer=opt) if vit_layers else MemoryEstimate(0.0, 0.0)
        both = MemoryEstimate(llm.states + vit.states, llm.activations + vit.activations)
        worst = max(worst, both, key=lambda m: m.total)
    return worst


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
                split = colocated_split(vit.forward, costs[1].forward / bb.layers, bb.layers, enc.layers, pp)
                stage0 = enc.params + (split[0] - enc.layers) * bb.layer_params + bb.vocab * bb.hidden
                for dp in divisors(workload.global_batch // mbs):
                    if tp * pp * dp > cluster.devices:
                        break
                    floor = colocated_memory(model, workload, tp, dp, mbs, split, (1,) * pp)
                    if floor.total > cluster.memory_limit:
                        rejections.append(Rejection("colocated", f"tp {tp} pp {pp} mbs {mbs} dp {dp}", "memory",
                                                    floor.total, cluster.memory_limit, "GiB", at_least=True))
                        continue
                    reduce = proxy.gradient_reduce_seconds(stage0, tp, dp)
                    shortest = step_lower_bound(_layout(model, split), costs, workload.global_batch // (dp * mbs))
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
