"""``solve``: candidates from the proxy, the MILP, then the plan and its runners-up."""

from __future__ import annotations

from .candidates import CandidateSet, LazyPool, candidates
from .colocated import colocated_pool
from .diagnose import diagnose
from .errors import InfeasibleError
from .milp import AllocationMilp, Choice
from .plan import COLOCATED, AllocationPlan, BackboneConfig, EncoderConfig, Prediction
from .proxy import ProxyModel
from .specs import GIB, ClusterSpec, ModelSpec, Workload

FIRST_SIMULATED = 1  # candidates of each pool simulated before the first solve (doubling while none fits)
BOUND_SLACK = 1e-6  # relative: well above the MILP's lexicographic tolerance

# A shape: placement, tp, pp, micro batch (runners-up differ in it).
Shape = tuple[str, int, int, int]


def _shape(candidate, placement: str) -> Shape:
    return placement, candidate.tp, candidate.pp, candidate.micro_batch


def unrunnable_pairs(found: CandidateSet, blocks: bool = True) -> list[tuple[list[int], list[int]]]:
    """``(encoders, backbones)`` index groups no runtime of the workload runs together: the
    encoder's replicas not a multiple of the backbone's (:attr:`Workload.encoder_split`),
    or with ``blocks`` (:attr:`Workload.megatron_blocks`: one Megatron world) also its
    devices not a multiple of the backbone's ``tp x pp`` block.  One group per backbone
    (block, replicas), so the MILP gets one row per group."""
    groups: dict[tuple[int, int], list[int]] = {}
    for j, b in enumerate(found.backbones):
        groups.setdefault((b.tp * b.pp if blocks else 1, b.dp), []).append(j)
    out = []
    for (block, dp), backbones in groups.items():
        encoders = [i for i, e in enumerate(found.encoders) if e.devices % block or e.dp % dp]
        if encoders:
            out.append((encoders, backbones))
    return out


def build_milp(found: CandidateSet, joints: list, budget: int, excluded: list[Shape], workload: Workload,
               verbose: bool = False) -> AllocationMilp:
    """The MILP over the candidates simulated so far, with the ``excluded`` shapes cut off
    and the workload's runtime requirements (Megatron blocks, every device) imposed."""
    milp = AllocationMilp(
        [e.rate for e in found.encoders], [e.devices for e in found.encoders], [e.dp for e in found.encoders],
        [b.rate for b in found.backbones], [b.devices for b in found.backbones], [b.dp for b in found.backbones],
        budget, [j.rate for j in joints], [j.devices for j in joints], [j.dp for j in joints],
        exact_budget=workload.exact_devices, verbose=verbose,
    )
    if workload.megatron_blocks or workload.encoder_split:
        for encoders, backbones in unrunnable_pairs(found, blocks=workload.megatron_blocks):
            milp.forbid_pairs(encoders, backbones)
    banned = [i for i, b in enumerate(found.backbones) if _shape(b, "decoupled") in excluded]
    if banned:
        milp.exclude_backbone(banned)
    banned = [i for i, j in enumerate(joints) if _shape(j, COLOCATED) in excluded]
    if banned:
        milp.exclude_joint(banned)
    return milp


def to_plan(found: CandidateSet, joints: list, choice: Choice, model: ModelSpec, proxy: ProxyModel,
            workload: Workload) -> AllocationPlan:
    """The :class:`AllocationPlan` of the MILP's choice, with what the proxy predicts for it."""
    if choice.joint is not None:
        j = joints[choice.joint]
        memory_gib = j.memory.total / GIB
        return AllocationPlan(
            encoder=EncoderConfig(dp=j.dp, tp=j.tp, layers=model.encoder.layers),
            backbone=BackboneConfig(dp=j.dp, tp=j.tp, pp=j.pp, micro_batch=j.micro_batch, layer_split=j.llm_split),
            global_batch=workload.global_batch,
            predicted=Prediction(
                throughput=j.rate, production=j.rate, consumption=j.rate,
                mfu=proxy.mfu(model.encoder, model.backbone, j.rate, j.devices),
                bubble_fraction=j.bubble_fraction, backbone_step_s=j.step_time, microbatches=j.microbatches,
                encoder_memory_gib=memory_gib, backbone_memory_gib=memory_gib,
            ),
            placement=COLOCATED,
        )
    enc, bb = found.encoders[choice.encoder], found.backbones[choice.backbone]
    devices = enc.devices + bb.devices
    return AllocationPlan(
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


def runtime_requirements(workload: Workload) -> list[str]:
    """The workload's runtime requirements, named for a diagnosis."""
    named = [("megatron_blocks", workload.megatron_blocks),
             ("encoder_split", workload.encoder_split and not workload.megatron_blocks),
             ("exact_devices", workload.exact_devices)]
    return [name for name, on in named if on]


def _solve_lazily(found: CandidateSet, pools: list[LazyPool], joints: list, budget: int,
                  excluded: list[Shape], workload: Workload, verbose: bool) -> Choice | None:
    """The MILP optimum over all candidates, simulating only those that could be part of
    it: after each solve with throughput ``T``, every pending candidate whose rate bound
    reaches ``T`` is simulated and the MILP solved again.  When none is left, the pending
    ones run at less than ``T`` and can be in no plan as good (nor, with ``T`` fixed, in
    the mismatch and device stages); the workload's runtime requirements only remove
    plans, so a reach stays an upper bound under them.  While no plan exists yet, the next best-bounded
    candidates are simulated, twice as many each round, until one does or none is left."""
    batch = FIRST_SIMULATED
    while True:
        choice = None
        if (found.encoders and found.backbones) or joints:
            choice = build_milp(found, joints, budget, excluded, workload, verbose).solve()
        if choice is None:
            if not any(pool.pending for pool in pools):
                return None
            for pool in pools:
                pool.expand_first(batch)
            batch *= 2
        elif sum(pool.expand(choice.throughput * (1 - BOUND_SLACK)) for pool in pools) == 0:
            return choice


def solve(model_spec: ModelSpec, cluster_spec: ClusterSpec, proxy: ProxyModel, workload: Workload, *,
          verbose: bool = False) -> AllocationPlan:
    """The plan that maximises global throughput (the smaller of encoder production and
    backbone consumption, samples/s), then minimises their mismatch, then the devices used;
    with ``workload.alternatives`` runners-up, each with another backbone shape.  With
    ``"colocated"`` in ``workload.placements`` the encoder may also sit inside the
    backbone's stage 0 (one strategy for both, :mod:`.colocated`).  ``workload.megatron_blocks``,
    ``workload.encoder_split`` and ``workload.exact_devices`` restrict the plans to those a runtime runs
    (constraints of the MILP, so the plan is the best of those).  HiGHS prints nothing
    (not even its banner) unless ``verbose``.

    Raises :class:`~.errors.InfeasibleError` naming the binding constraint.
    """
    found, pool = candidates(model_spec.encoder, model_spec.backbone, cluster_spec, workload, proxy)
    pools = [pool]
    joints: list = []
    if COLOCATED in workload.placements:
        joint_pool = colocated_pool(model_spec, cluster_spec, workload, proxy, found.rejections)
        joints = joint_pool.evaluated
        pools.append(joint_pool)
    if "decoupled" not in workload.placements:
        pool.pending.clear()
    excluded: list[Shape] = []
    choice = _solve_lazily(found, pools, joints, cluster_spec.devices, excluded, workload, verbose)
    if choice is None:
        raise InfeasibleError(diagnose(found, cluster_spec, "decoupled" in workload.placements,
                                       runtime_requirements(workload)))
    best = to_plan(found, joints, choice, model_spec, proxy, workload)
    runners_up = []
    for _ in range(workload.alternatives):
        if choice.joint is not None:
            excluded.append(_shape(joints[choice.joint], COLOCATED))
        else:
            excluded.append(_shape(found.backbones[choice.backbone], "decoupled"))
        choice = _solve_lazily(found, pools, joints, cluster_spec.devices, excluded, workload, verbose)
        if choice is None:
            break
        runners_up.append(to_plan(found, joints, choice, model_spec, proxy, workload))
    return AllocationPlan(best.encoder, best.backbone, best.global_batch, best.predicted, tuple(runners_up),
                          best.placement)
