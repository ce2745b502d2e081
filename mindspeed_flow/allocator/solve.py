"""``solve``: candidates from the proxy, the MILP, then the plan and its runners-up."""

from __future__ import annotations

from .candidates import BackbonePool, CandidateSet, candidates
from .diagnose import InfeasibleError, diagnose
from .milp import AllocationMilp, Choice
from .plan import BackboneConfig, EncoderConfig, Plan, Prediction
from .proxy import ProxyModel
from .specs import GIB, ClusterSpec, ModelSpec, Workload


def build_milp(found: CandidateSet, budget: int) -> AllocationMilp:
    return AllocationMilp(
        [e.rate for e in found.encoders], [e.devices for e in found.encoders], [e.dp for e in found.encoders],
        [b.rate for b in found.backbones], [b.devices for b in found.backbones], [b.dp for b in found.backbones],
        budget,
    )


def to_plan(found: CandidateSet, choice: Choice, model: ModelSpec, proxy: ProxyModel,
            workload: Workload) -> Plan:
    enc, bb = found.encoders[choice.encoder], found.backbones[choice.backbone]
    devices = enc.devices + bb.devices
    return Plan(
        encoder=EncoderConfig(dp=enc.dp, tp=enc.tp, layers=model.encoder.layers),
        backbone=BackboneConfig(dp=bb.dp, tp=bb.tp, pp=bb.pp, micro_batch=bb.micro_batch, layer_split=bb.split),
        global_batch=workload.global_batch,
        predicted=Prediction(
            throughput=float(choice.throughput), production=enc.rate, consumption=bb.rate,
            mfu=proxy.mfu(model.encoder, model.backbone, choice.throughput, devices),
            bubble_fraction=bb.bubble_fraction, backbone_step_s=bb.step_time, microbatches=bb.microbatches,
            encoder_memory_gib=enc.memory.total / GIB, backbone_memory_gib=bb.memory.total / GIB,
        ),
    )


FIRST_SIMULATED = 16  # backbone candidates simulated before the first solve
BOUND_SLACK = 1e-6  # relative: well above the MILP's lexicographic tolerance


def _solve_lazily(found: CandidateSet, pool: BackbonePool, budget: int,
                  excluded_shapes: list[tuple[int, int, int]]) -> Choice | None:
    """The MILP optimum over all backbone candidates, simulating only those that could be
    part of it: after each solve with throughput ``T``, every pending candidate whose rate
    bound reaches ``T`` is simulated and the MILP solved again.  When none is left, the
    pending ones consume less than ``T`` and can be in no plan as good (nor, with ``T``
    fixed, in the mismatch and device stages)."""
    while True:
        choice = None
        if found.encoders and found.backbones:
            milp = build_milp(found, budget)
            banned = [j for j, b in enumerate(found.backbones) if (b.tp, b.pp, b.micro_batch) in excluded_shapes]
            if len(banned) < len(found.backbones):
                if banned:
                    milp.exclude_backbone(banned)
                choice = milp.solve()
        threshold = choice.throughput * (1 - BOUND_SLACK) if choice else 0.0
        if pool.expand(threshold) == 0 and (choice is not None or not pool.pending):
            return choice


def solve(model_spec: ModelSpec, cluster_spec: ClusterSpec, proxy: ProxyModel, workload: Workload) -> Plan:
    """The plan that maximises global throughput (the smaller of encoder production and
    backbone consumption, samples/s), then minimises their mismatch, then the devices used;
    with ``workload.alternatives`` runners-up, each with another backbone shape.

    Raises :class:`~.diagnose.InfeasibleError` naming the binding constraint.
    """
    found, pool = candidates(model_spec.encoder, model_spec.backbone, cluster_spec, workload, proxy)
    pool.expand_first(FIRST_SIMULATED)
    excluded: list[tuple[int, int, int]] = []
    choice = _solve_lazily(found, pool, cluster_spec.devices, excluded)
    if choice is None:
        raise InfeasibleError(diagnose(found, cluster_spec))
    best = to_plan(found, choice, model_spec, proxy, workload)
    runners_up = []
    for _ in range(workload.alternatives):
        chosen = found.backbones[choice.backbone]
        excluded.append((chosen.tp, chosen.pp, chosen.micro_batch))
        choice = _solve_lazily(found, pool, cluster_spec.devices, excluded)
        if choice is None:
            break
        runners_up.append(to_plan(found, choice, model_spec, proxy, workload))
    return Plan(best.encoder, best.backbone, best.global_batch, best.predicted, tuple(runners_up))
