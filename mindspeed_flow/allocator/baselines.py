"""The two baselines the allocator is compared with, evaluated by the same proxy and
schedule simulator as its plans.

- :func:`megatron_uniform`: one parallel strategy for the whole model, Megatron /
  MindSpeed-MM style: the ViT inside pipeline stage 0 of the LLM's 1F1B (every device
  runs the same TP, the stages hold ``[ViT + k LLM layers, ...]``).  It gets its best
  config by search over tp, pp, micro batch and dp, with ``k`` chosen per shape to
  balance stage 0 against the others by their per-layer times (the split MindSpeed-MM
  users tune by hand, like 72B's ``[6, 11, ..., 8]``).
- :func:`disttrain_like`: encoder and backbone on devices of their own (as in the plan),
  but the encoder's share of the devices is its share of the training FLOPs, as in
  DistTrain's sizing; within each share the best config is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import memory
from .candidates import candidates, divisors
from .memory import MemoryEstimate
from .pipeline import HEAD_REGION, LAYERS_REGION, PipelineLayout, pipeline_step, step_lower_bound
from .proxy import ProxyModel
from .specs import ClusterSpec, ModelSpec, Workload

VIT_REGION = "vit"


@dataclass(frozen=True)
class BaselineResult:
    """A baseline's best configuration and its predicted samples/s."""

    name: str
    throughput: float
    devices: int
    config: str
    mfu: float


def colocated_split(vit_forward: float, layer_forward: float, layers: int, vit_layers: int,
                    stages: int) -> tuple[int, ...]:
    """Stage 0 = ViT + ``k`` LLM layers, the other layers spread evenly over the rest, with
    ``k`` balancing stage 0's forward time against a later stage's (layers per stage,
    counted over ViT + LLM, as MindSpeed-MM's ``pipeline_num_layers`` lists add up)."""
    if stages == 1:
        return (vit_layers + layers,)

    def slowest(k: int) -> float:
        rest = -(-(layers - k) // (stages - 1))
        return max(vit_forward + k * layer_forward, rest * layer_forward)

    k = min(range(0, layers - stages + 2), key=slowest)
    rest = layers - k
    share = [rest // (stages - 1) + (1 if i < rest % (stages - 1) else 0) for i in range(stages - 1)]
    return (vit_layers + k,) + tuple(share)


def _colocated_memory(model: ModelSpec, workload: Workload, tp: int, dp: int, mbs: int, split: tuple[int, ...],
                      live: tuple[int, ...]) -> float:
    """The fullest stage: stage 0 holds the ViT and the embedding besides its LLM layers."""
    enc, bb = model.encoder, model.backbone
    opt = workload.distributed_optimizer
    worst = 0.0
    for s, count in enumerate(split):
        vit_layers = enc.layers if s == 0 else 0
        llm = memory.stage_memory(bb, layers=count - vit_layers, tp=tp, dp=dp, samples=mbs, live=live[s],
                                  first=s == 0, last=s == len(split) - 1, distributed_optimizer=opt)
        vit = memory.stage_memory(enc, layers=vit_layers, tp=tp, dp=dp, samples=mbs,
                                  live=live[s] if enc.trainable else 0, first=False, last=False,
                                  distributed_optimizer=opt) if vit_layers else MemoryEstimate(0.0, 0.0)
        worst = max(worst, llm.total + vit.total)
    return worst


def megatron_uniform(model: ModelSpec, cluster: ClusterSpec, proxy: ProxyModel,
                     workload: Workload) -> BaselineResult | None:
    """The best single strategy for the whole model (see the module docstring).  Every
    config is considered; they are simulated best rate bound first
    (:func:`.pipeline.step_lower_bound`), stopping once no bound reaches the best rate."""
    enc, bb = model.encoder, model.backbone
    node = cluster.devices_per_node
    options = []
    for tp in workload.tp_choices:
        if node % tp or any(s.heads % tp or s.query_groups % tp for s in (enc, bb)):
            continue
        for pp in workload.pp_choices or tuple(divisors(bb.layers)):
            if pp > bb.layers or tp * pp > cluster.devices:
                continue
            for mbs in workload.micro_batch_choices:
                if workload.global_batch % mbs:
                    continue
                vit = proxy.region_cost("encoder", enc, tp, mbs, enc.layers)
                costs = proxy.backbone_costs(bb, tp, mbs)
                split = colocated_split(vit.forward, costs[0].forward / bb.layers, bb.layers, enc.layers, pp)
                layout = PipelineLayout(((VIT_REGION, enc.layers, enc.trainable), (LAYERS_REGION, bb.layers, True),
                                         (HEAD_REGION, 1, True)), split[:-1] + (split[-1] + 1,))
                stage0 = enc.params + (split[0] - enc.layers) * bb.layer_params + bb.vocab * bb.hidden
                for dp in divisors(workload.global_batch // mbs):
                    if tp * pp * dp > cluster.devices:
                        break
                    if _colocated_memory(model, workload, tp, dp, mbs, split, (1,) * pp) > cluster.memory_limit:
                        continue  # even one microbatch in flight does not fit
                    reduce = proxy.gradient_reduce_seconds(stage0, tp, dp)
                    microbatches = workload.global_batch // (dp * mbs)
                    bound = workload.global_batch / (step_lower_bound(layout, (vit,) + costs, microbatches) + reduce)
                    options.append((bound, tp, pp, mbs, dp, split, layout, (vit,) + costs, reduce))
    best: BaselineResult | None = None
    for bound, tp, pp, mbs, dp, split, layout, costs, reduce in sorted(options, key=lambda o: -o[0]):
        if best is not None and bound < best.throughput:
            break
        sim = pipeline_step(layout, workload.global_batch // (dp * mbs), costs, proxy.stage_link(tp, pp))
        if _colocated_memory(model, workload, tp, dp, mbs, split, sim.peak_live) > cluster.memory_limit:
            continue
        rate = workload.global_batch / (sim.step_time + reduce)
        if best is None or rate > best.throughput:
            devices = tp * pp * dp
            best = BaselineResult("megatron-uniform", rate, devices,
                                  f"dp {dp} x tp {tp} x pp {pp}, mbs {mbs}, split {list(split)}",
                                  proxy.mfu(enc, bb, rate, devices))
    return best


def flops_share(model: ModelSpec) -> float:
    """The encoder's share of one sample's training FLOPs (3x forward when trained)."""
    enc, bb = model.encoder, model.backbone
    e = (3.0 if enc.trainable else 1.0) * enc.forward_flops(1)
    return e / (e + (3.0 if bb.trainable else 1.0) * bb.forward_flops(1))


def disttrain_like(model: ModelSpec, cluster: ClusterSpec, proxy: ProxyModel,
                   workload: Workload) -> BaselineResult | None:
    """Devices split by FLOPs share, then the best config of each module in its share."""
    found, pool = candidates(model.encoder, model.backbone, cluster, workload, proxy)
    budget = max(1, round(flops_share(model) * cluster.devices))
    fitting = [e for e in found.encoders if e.devices <= budget]
    if not fitting:  # the share is below the smallest encoder: give it that one
        fitting = [min(found.encoders, key=lambda e: e.devices)] if found.encoders else []
    if not fitting:
        return None
    enc = max(fitting, key=lambda e: e.rate)
    bb = pool.best_within(cluster.devices - enc.devices)
    if bb is None:
        return None
    rate = min(enc.rate, bb.rate)
    devices = enc.devices + bb.devices
    return BaselineResult("disttrain-like", rate, devices,
                          f"encoder dp {enc.dp} x tp {enc.tp} (share {budget} devices); backbone dp {bb.dp} x "
                          f"tp {bb.tp} x pp {bb.pp}, mbs {bb.micro_batch}",
                          proxy.mfu(model.encoder, model.backbone, rate, devices))
