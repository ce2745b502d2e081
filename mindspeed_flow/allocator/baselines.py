"""The two baselines the allocator is compared with, evaluated by the same proxy and
schedule simulator as its plans.

- :func:`megatron_uniform`: one parallel strategy for the whole model, Megatron /
  MindSpeed-MM style: the ViT inside pipeline stage 0 of the LLM's 1F1B (see
  :mod:`.colocated`), its best config by search over tp, pp, micro batch and dp.
- :func:`disttrain_like`: encoder and backbone on devices of their own (as in the plan),
  but the encoder's share of the devices is its share of the training FLOPs, as in
  DistTrain's sizing; within each share the best config is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

from .candidates import candidates
from .colocated import colocated_pool
from .proxy import ProxyModel
from .specs import ClusterSpec, ModelSpec, Workload


@dataclass(frozen=True)
class BaselineResult:
    """A baseline's best configuration and its predicted samples/s."""

    name: str
    throughput: float
    devices: int
    config: str
    mfu: float


def megatron_uniform(model: ModelSpec, cluster: ClusterSpec, proxy: ProxyModel,
                     workload: Workload) -> BaselineResult | None:
    """The best co-located config (:mod:`.colocated`): every config is considered, simulated
    best rate bound first (:func:`.pipeline.step_lower_bound`) until no bound reaches the
    best rate found."""
    best = colocated_pool(model, cluster, workload, proxy, []).best_within(cluster.devices)
    if best is None:
        return None
    return BaselineResult("megatron-uniform", best.rate, best.devices,
                          f"dp {best.dp} x tp {best.tp} x pp {best.pp}, mbs {best.micro_batch}, split {list(best.split)}",
                          proxy.mfu(model.encoder, model.backbone, best.rate, best.devices))


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
