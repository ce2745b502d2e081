"""Why an instance has no plan: the constraint that leaves nothing, and by how much.

Either a module has no candidate left (each constraint that removed some is named with its
closest miss: the smallest memory footprint against the limit, the smallest replica
against the budget, ...), or both have candidates but no pair fits the device budget
together (the smallest pair is named with its shortfall).
"""

from __future__ import annotations

from typing import Sequence

from .candidates import CandidateSet, Rejection
from .specs import ClusterSpec


OWN_CONSTRAINTS = ("memory", "devices")  # checked per placement, not shared with co-located configs


def _closest(rejections: list[Rejection]) -> Rejection:
    """The rejection that misses by least (relative to what is allowed)."""
    def miss(r: Rejection) -> float:
        return (r.needed - r.allowed) / r.allowed if r.constraint in ("memory", "devices") else 0.0
    return min(rejections, key=miss)


def module_reasons(module: str, rejections: list[Rejection]) -> list[str]:
    ours = [r for r in rejections if r.module == module]
    if not ours:
        return [f"{module}: no configuration to choose from (empty tp/pp/micro batch choices?)"]
    lines = []
    for constraint in dict.fromkeys(r.constraint for r in ours):
        group = [r for r in ours if r.constraint == constraint]
        closest = _closest(group)
        lines.append(f"{module}: {len(group)} config(s) break {constraint}; closest: {closest.describe()}")
    return [f"no {module} configuration is feasible:"] + ["  " + line for line in lines]


def diagnose(found: CandidateSet, cluster: ClusterSpec, decoupled: bool = True,
             requirements: Sequence[str] = ()) -> list[str]:
    """One line per binding constraint (co-located candidates, when they were considered
    and none fits, are named too).  Without the ``decoupled`` placement a module is named
    only for what it rejected itself (TP, divisibility: checks co-located configs share),
    never for candidates that were simply not asked for.  ``requirements`` names the
    workload's runtime requirements (``megatron_blocks``, ``encoder_split``, ``exact_devices``): when every
    module has candidates and a pair fits the budget, they are what leaves no plan."""
    reasons = []
    # Co-located configs record their own memory and device-budget misses.
    asked = found.rejections if decoupled else [r for r in found.rejections if r.constraint not in OWN_CONSTRAINTS]
    for module, left in (("encoder", found.encoders), ("backbone", found.backbones)):
        if not left and (decoupled or any(r.module == module for r in asked)):
            reasons += module_reasons(module, asked)
    if any(r.module == "colocated" for r in found.rejections):
        reasons += module_reasons("colocated", found.rejections)
    if not decoupled or not found.encoders or not found.backbones:
        return reasons + _requirement_reasons(requirements, cluster, reasons)
    enc = min(found.encoders, key=lambda e: e.devices)
    bb = min(found.backbones, key=lambda b: b.devices)
    need = enc.devices + bb.devices
    if need > cluster.devices:
        return reasons + [
            f"device budget: the smallest plan needs {need} devices (encoder tp {enc.tp} dp {enc.dp}: "
            f"{enc.devices} + backbone tp {bb.tp} pp {bb.pp} dp {bb.dp}: {bb.devices}), the budget is "
            f"{cluster.devices}: short by {need - cluster.devices}"]
    if requirements:
        return reasons + _requirement_reasons(requirements, cluster, reasons)
    return reasons + [f"HiGHS found no plan although the smallest pair ({need} devices) fits {cluster.devices}: "
                      "please report this instance"]


def _requirement_reasons(requirements: Sequence[str], cluster: ClusterSpec, reasons: list[str]) -> list[str]:
    """The runtime requirements as the reason, when no other constraint already is one."""
    if not requirements or reasons:
        return []
    rules = {"megatron_blocks": "each encoder's devices filling whole backbone tp x pp blocks and its replicas "
                                "splitting evenly over the backbone's",
             "encoder_split": "its replicas splitting evenly over the backbone's",
             "exact_devices": f"the plan using all {cluster.devices} devices"}
    return [f"runtime requirements: no encoder and backbone pair (or co-located config) fits the budget with "
            + " and with ".join(rules[r] for r in requirements)]
