"""Paper-scale comparisons described in YAML (``configs/sim/*.yaml``).

A config names one model (a ViT region and an LLM region with their costs), a device
budget and several schedules, each one of four layouts built from the algebra:

``megatron``   the ViT inside stage 0 of one 1F1B (both regions share one skeleton, cut by
               ``layers`` like MindSpeed-MM's ``pipeline_num_layers``);
``disttrain``  the ViT on ``encoder_stages`` stages of its own, in lockstep with the LLM's
               1F1B (one longer pipeline);
``transpose``  Mpipe's ``<transpose, 1f1b>``: the ViT replicated over the LLM's stages,
               ``transpose_order: ready|prefix`` and ``transpose_backward: owner|recompute``
               (see :class:`.Transpose`);
``decoupled``  FlowTrain's producer on ``encoder_ranks`` ranks of its own, through the pool;
``three-phase`` the co-located step of MindSpeed-MM's ``--hetero-parallel`` and Megatron
               MIMO: the ViT data-parallel over the LLM's ranks runs the step's forwards,
               the LLM its 1F1B on the embeddings, then the ViT its backwards
               (``Transpose(order="phased")``).

``megatron`` takes ``layers: search``: every split with the ViT and ``k`` LLM layers on
stage 0 and the other LLM layers spread evenly is simulated and the fastest kept, so the
baseline gets its best split rather than a hand-picked one (the row names the split).

Every layout takes ``backbone``: the LLM's sharded skeleton, ``1f1b`` (default), ``zb-h1`` or
``zb-v`` (:mod:`.zero_bubble`), so ``{layout: transpose, backbone: zb-h1}`` is
``<transpose, zb-h1>``.  ``transpose`` and ``decoupled`` take ``encoder_in_flight``: the most microbatches whose
ViT activations one rank holds (see ``max_in_flight`` of the replicated skeletons).

A config's ``search`` gives a small grid every schedule is tried on, keeping the candidate
with the most throughput per device that fits ``device_memory_gib`` (peak activations plus
the LLM's ``states_mb`` over its stages): ``stages`` (PP), ``microbatch_size`` (packs per
microbatch: fewer, longer microbatches) and ``encoder_devices`` (the devices of an encoder
rank of its own, ``disttrain`` and ``decoupled`` alike).  So every baseline runs at its best
PP and microbatch size, and DistTrain-like sizes its encoder rank by FlowTrain's rule.

Every schedule is simulated for ``seeds`` steps (encoder jitter and pack costs differ per
step) and compared per device: a simulated rank is a group of ``devices_per_rank`` devices
(the TP group; encoder-only ranks may be smaller), one simulated pipeline is one data
parallel replica, and the budget's devices are divided into replicas fractionally, so a
layout with extra encoder ranks pays for them exactly.  A region's ``forward_ms`` holds for
``forward_devices`` devices (default: ``devices_per_rank``) and scales inversely with the
devices that run it, so one ViT costs the same on the same devices in every config.  Each
schedule is also composed and simulated for blocking sends (``rendezvous``), reported beside
the eager step, and compared with the config's first row and with its ``disttrain`` row.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

from .actions import COMPUTE
from .compose import compose
from .costs import CostTable, Jitter, Link, RegionCost, pack_scale
from .errors import ScheduleError
from .gantt import draw
from .plan import Plan
from .regions import BACKBONE_REGION, ENCODER_REGION, Region
from .simulate import SimResult, simulate
from .skeletons import PHASED, Decoupled, OneFOneB, Transpose
from .validate import validate
from .zero_bubble import ZeroBubbleH1, ZeroBubbleV

LAYOUTS = ("megatron", "disttrain", "transpose", "decoupled", "three-phase")
# layouts whose encoder runs on ranks of its own (sized by ``encoder_devices_per_rank``)
OWN_ENCODER_RANKS = ("disttrain", "decoupled")
BACKBONES = {"1f1b": OneFOneB, "zb-h1": ZeroBubbleH1, "zb-v": ZeroBubbleV}
_MB = 2**20


@dataclass(frozen=True)
class Row:
    """One schedule's averages over the simulated steps."""

    name: str
    layout: str
    ranks: int
    devices: int  # per replica
    step: float
    bubble: float
    util_min: float
    util_max: float
    peak_gib: float
    throughput: float  # packs per second over the whole device budget
    speedup: float  # over the config's first schedule
    vs_disttrain: float | None  # over the config's disttrain schedule (Mpipe's own baseline)
    rendezvous: float  # mean step with blocking sends (compose's rendezvous programs)
    seeds: int  # simulated steps the means are over; charts draw the first (seed 0)
    split: tuple[int, ...] | None = None  # the megatron layout's layers per stage
    stages: int = 0  # the LLM's pipeline stages (PP)
    microbatch_size: int = 1  # packs per microbatch
    encoder_devices: int | None = None  # devices of an encoder rank of its own


def load(path: str | Path) -> dict[str, Any]:
    import yaml

    with open(path) as f:
        return yaml.safe_load(f)


def build_regions(config: Mapping[str, Any], schedule: Mapping[str, Any]) -> list[Region]:
    """The regions of one schedule entry: the ViT and the LLM under the entry's layout."""
    vit, llm = _need(config, "regions", ENCODER_REGION), _need(config, "regions", BACKBONE_REGION)
    layout = schedule.get("layout")
    stages = _need(schedule, "stages")
    backbone = BACKBONES.get(schedule.get("backbone", "1f1b"))
    if backbone is None:
        raise ScheduleError(f"schedule {schedule.get('name')!r}: backbone {schedule['backbone']!r} "
                            f"is not one of {tuple(BACKBONES)}")
    llm_skeleton = backbone(stages=stages)
    if schedule.get("layers") == "search":
        raise ScheduleError(f"schedule {schedule.get('name')!r}: layers: search is resolved by best_split first")
    if layout == "megatron":
        shared = backbone(stages=stages, layers=tuple(schedule["layers"]) if "layers" in schedule else None)
        vit_skeleton = llm_skeleton = shared
    elif layout == "disttrain":
        # the ViT's stages name their layers, so that at PP 1 they are not the LLM's one
        # skeleton value (equal skeletons are cut together: the megatron layout)
        encoder_stages = schedule.get("encoder_stages", 1)
        vit_layers = _need(config, "regions", ENCODER_REGION, "layers")
        vit_skeleton = backbone(stages=encoder_stages, layers=tuple(
            vit_layers // encoder_stages + (i < vit_layers % encoder_stages) for i in range(encoder_stages)))
    elif layout == "transpose":
        vit_skeleton = Transpose(max_in_flight=schedule.get("encoder_in_flight"),
                                 order=schedule.get("transpose_order", "ready"),
                                 backward=schedule.get("transpose_backward", "owner"))
    elif layout == "three-phase":
        vit_skeleton = Transpose(order=PHASED)
    elif layout == "decoupled":
        vit_skeleton = Decoupled(
            max_in_flight=schedule.get("encoder_in_flight"), ranks=schedule.get("encoder_ranks", 1)
        )
    else:
        raise ScheduleError(f"schedule {schedule.get('name')!r}: layout {layout!r} is not one of {LAYOUTS}")
    return [
        Region(ENCODER_REGION, _need(config, "regions", ENCODER_REGION, "layers"), vit_skeleton,
               trainable=vit.get("trainable", True)),
        Region(BACKBONE_REGION, _need(config, "regions", BACKBONE_REGION, "layers"), llm_skeleton,
               trainable=llm.get("trainable", True)),
    ]


def build_costs(config: Mapping[str, Any], schedule: Mapping[str, Any], seed: int) -> CostTable:
    """Costs of one simulated step of one schedule entry: encoder jitter and pack-cost
    spread drawn from ``seed``.  A region's time scales inversely with the devices running
    it (ideal scaling): the ViT runs on ``encoder_devices_per_rank`` devices (default: a
    full rank), the LLM on ``devices_per_rank``.  A microbatch of ``microbatch_size`` packs
    costs that many packs' time and bytes (its packs' cost spread averages out)."""
    per_rank = _need(config, "devices_per_rank")
    size = schedule.get("microbatch_size", 1)
    devices = {ENCODER_REGION: schedule.get("encoder_devices_per_rank", per_rank)}
    regions = {
        name: _region_cost(spec, seed, spec.get("forward_devices", per_rank) / devices.get(name, per_rank), size)
        for name, spec in _need(config, "regions").items()
    }
    cv = _need(config, "packing_cv", schedule.get("packing", "unbalanced"))
    rng = random.Random(f"packs:{seed}")
    each = [max(0.2, rng.gauss(1.0, cv)) for _ in range(_need(config, "num_microbatches"))]
    packs = [sum(each[i:i + size]) for i in range(0, len(each) - size + 1, size)]
    return CostTable(
        regions=regions,
        link=_link(config.get("link", {})),
        pool=_link(config["pool"]) if "pool" in config else None,
        microbatch_scale=pack_scale({BACKBONE_REGION: packs}),
    )


def scenario_plan(config: Mapping[str, Any], schedule: Mapping[str, Any], semantics: str = "eager") -> Plan:
    """Compose and validate one schedule entry of a simulation config; its nominal costs
    order shared ranks.  (The runtime composes its plans from regions alone:
    :func:`mindspeed_flow.runtime.layout.plan_for`.)"""
    schedule = best_split(config, schedule)
    nominal = build_costs(config, schedule, seed=0).nominal()
    plan = compose(build_regions(config, schedule), _microbatches(config, schedule),
                   duration=nominal.compute_seconds, semantics=semantics)
    validate(plan)
    return plan


def _microbatches(config: Mapping[str, Any], schedule: Mapping[str, Any]) -> int:
    """Microbatches per step: the config's packs per step over the packs per microbatch."""
    packs, size = _need(config, "num_microbatches"), schedule.get("microbatch_size", 1)
    if size < 1 or packs % size:
        raise ScheduleError(f"schedule {schedule.get('name')!r}: microbatch_size {size} does not "
                            f"divide the step's {packs} packs")
    return packs // size


def candidates(config: Mapping[str, Any], schedule: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """``schedule`` on every point of the config's ``search`` grid (itself when none)."""
    grid = config.get("search", {})
    per_rank = _need(config, "devices_per_rank")
    own = schedule.get("layout") in OWN_ENCODER_RANKS
    encoder = [d for d in grid.get("encoder_devices", []) if d <= per_rank] if own else []
    return [
        {**schedule, "stages": p, "microbatch_size": k,
         **({"encoder_devices_per_rank": d} if d is not None else {})}
        for p in grid.get("stages", [_need(schedule, "stages")])
        for k in grid.get("microbatch_size", [schedule.get("microbatch_size", 1)])
        for d in (encoder or [schedule.get("encoder_devices_per_rank")])
    ]


def best_layout(config: Mapping[str, Any], schedule: Mapping[str, Any]) -> tuple[Mapping[str, Any], list[SimResult], Plan]:
    """The candidate of :func:`candidates` with the most throughput per device whose peak
    memory per device fits ``device_memory_gib`` (no limit without it), its split searched
    by :func:`best_split`; with its simulated steps and plan.  Raises when none fits."""
    limit = config.get("device_memory_gib")
    best = None
    for candidate in candidates(config, schedule):
        candidate = best_split(config, candidate)
        plan = scenario_plan(config, candidate)
        results = _simulated(config, candidate, plan)
        if limit is not None and _peak_gib(config, candidate, results) > limit:
            continue
        throughput = _throughput(config, candidate, plan, _mean(r.step_time for r in results))
        if best is None or throughput > best[0]:
            best = (throughput, candidate, results, plan)
    if best is None:
        raise ScheduleError(f"schedule {schedule.get('name')!r}: no candidate of the search grid fits "
                            f"device_memory_gib {limit}")
    return best[1:]


def _peak_gib(config: Mapping[str, Any], schedule: Mapping[str, Any], results: list[SimResult]) -> float:
    """Peak memory of a device: held activations plus the LLM's states over its stages."""
    states = _need(config, "regions", BACKBONE_REGION).get("states_mb", 0) * _MB / _need(schedule, "stages")
    return (max(max(r.peak_bytes.values()) for r in results) + states) / 2**30


def _throughput(config: Mapping[str, Any], schedule: Mapping[str, Any], plan: Plan, step: float) -> float:
    """Packs per second over the whole device budget (replicas counted fractionally)."""
    return _need(config, "num_microbatches") / step * _need(config, "devices") / _devices(config, schedule, plan)


def _devices(config: Mapping[str, Any], schedule: Mapping[str, Any], plan: Plan) -> int:
    """Devices of one replica: full ranks, and encoder-only ranks of their own size."""
    per_rank = _need(config, "devices_per_rank")
    encoder_ranks = _encoder_ranks(plan)
    return per_rank * (len(plan.programs) - encoder_ranks) + encoder_ranks * schedule.get(
        "encoder_devices_per_rank", per_rank)


def best_split(config: Mapping[str, Any], schedule: Mapping[str, Any]) -> Mapping[str, Any]:
    """``schedule`` with ``layers: search`` replaced by the fastest split of its kind: the
    ViT and ``k`` LLM layers on stage 0, the rest even (the extra layers on the last
    stages), judged by the mean simulated step over the config's seeds."""
    if schedule.get("layers") != "search":
        return schedule
    vit, llm = (_need(config, "regions", name, "layers") for name in (ENCODER_REGION, BACKBONE_REGION))
    stages = _need(schedule, "stages")
    if stages == 1:
        return {**schedule, "layers": [vit + llm]}
    best: tuple[float, Mapping[str, Any]] | None = None
    for k in range(0, min(llm - (stages - 1), -(-llm // stages)) + 1):
        rest, extra = divmod(llm - k, stages - 1)
        layers = [vit + k] + [rest + (i >= stages - 1 - extra) for i in range(stages - 1)]
        candidate = {**schedule, "layers": layers}
        step = _mean(r.step_time for r in _simulated(config, candidate, scenario_plan(config, candidate)))
        if best is None or step < best[0]:
            best = (step, candidate)
    return best[1]


def run(config: Mapping[str, Any], charts: Path | None = None) -> list[Row]:
    """Simulate every schedule of ``config`` under eager and rendezvous semantics; draw each
    one's first simulated step (seed 0) under ``charts``."""
    rows: list[Row] = []
    seeds = config.get("seeds", 1)
    for entry in _need(config, "schedules"):
        name = _need(entry, "name")
        schedule, results, plan = best_layout(config, entry)
        blocking = _simulated(config, schedule, scenario_plan(config, schedule, "rendezvous"))
        if charts is not None:
            title = f"{config.get('name', '')} {name}, seed 0 of {seeds} (table: mean {_mean(r.step_time for r in results):.2f} s)"
            draw(results[0], charts / f"{name}.png", title)
        step = _mean(r.step_time for r in results)
        throughput = _throughput(config, schedule, plan, step)
        rows.append(Row(
            name=name,
            layout=schedule["layout"],
            ranks=len(plan.programs),
            devices=_devices(config, schedule, plan),
            step=step,
            bubble=_mean(r.bubble_fraction for r in results),
            util_min=_mean(min(r.utilisation.values()) for r in results),
            util_max=_mean(max(r.utilisation.values()) for r in results),
            peak_gib=_peak_gib(config, schedule, results),
            throughput=throughput,
            speedup=throughput / rows[0].throughput if rows else 1.0,
            vs_disttrain=None,
            rendezvous=_mean(r.step_time for r in blocking),
            seeds=seeds,
            split=tuple(schedule["layers"]) if schedule["layout"] == "megatron" and "layers" in schedule else None,
            stages=schedule["stages"],
            microbatch_size=schedule.get("microbatch_size", 1),
            encoder_devices=schedule.get("encoder_devices_per_rank") if schedule["layout"] in OWN_ENCODER_RANKS else None,
        ))
    disttrain = next((r for r in rows if r.layout == "disttrain"), None)
    if disttrain is not None:
        rows = [replace(r, vs_disttrain=r.throughput / disttrain.throughput) for r in rows]
    return rows


def _simulated(config: Mapping[str, Any], schedule: Mapping[str, Any], plan: Plan) -> list[SimResult]:
    return [simulate(plan, build_costs(config, schedule, s)) for s in range(config.get("seeds", 1))]


def _encoder_ranks(plan: Plan) -> int:
    """Ranks that compute only the ViT (its own stages or producer ranks)."""
    return sum(
        1 for program in plan.programs.values()
        if {a.region for a in program if a.kind in COMPUTE} == {ENCODER_REGION}
    )


def format_table(title: str, rows: list[Row]) -> str:
    """One line per schedule: eager step and bubble, the rendezvous step beside it, and
    throughput per device over the first row and over the disttrain row."""
    header = (f"{'schedule':<24} {'layout':<11} {'pp':>3} {'mbs':>3} {'ranks':>5} {'dev':>4} {'step s':>8} "
              f"{'rdv s':>7} {'bubble':>7} {'util min-max':>13} {'peak GiB':>9} {'packs/s':>8} {'speedup':>8} "
              f"{'vs dist':>8}")
    lines = [title, header, "-" * len(header)]
    for r in rows:
        versus = f"{r.vs_disttrain:>7.2f}x" if r.vs_disttrain is not None else f"{'-':>8}"
        lines.append(
            f"{r.name:<24} {r.layout:<11} {r.stages:>3} {r.microbatch_size:>3} {r.ranks:>5} {r.devices:>4} "
            f"{r.step:>8.2f} {r.rendezvous:>7.2f} "
            f"{r.bubble:>7.1%} {r.util_min:>6.0%}-{r.util_max:<6.0%} {r.peak_gib:>9.1f} "
            f"{r.throughput:>8.1f} {r.speedup:>7.2f}x {versus}"
        )
    splits = [f"{r.name} layers {list(r.split)}" for r in rows if r.split]
    seeds = rows[0].seeds if rows else 0
    lines.append(f"means over {seeds} simulated steps (seeds 0..{seeds - 1}; each chart draws seed 0); "
                 "rdv: blocking sends; pp, mbs: the best of the search grid (mbs: packs per microbatch); "
                 "peak: activations plus LLM states per device; speedup: throughput per device over "
                 "the first row, vs dist: over the disttrain row" + (f"; {', '.join(splits)}" if splits else "")
                 + "".join(f"; {r.name} encoder rank of {r.encoder_devices} devices"
                           for r in rows if r.encoder_devices is not None))
    return "\n".join(lines)


def _region_cost(spec: Mapping[str, Any], seed: int, slowdown: float, size: int = 1) -> RegionCost:
    """A region's costs; ``slowdown`` scales its times (its devices' share of the reference),
    ``size`` (packs per microbatch) its times and activation bytes."""
    slowdown *= size
    forward = _need(spec, "forward_ms")
    jitter = None
    if isinstance(forward, list):
        low, high = (slowdown * f / 1e3 for f in forward)
        spike = slowdown * spec.get("spike_ms", 0.0) / 1e3
        jitter = Jitter(low, high, spec.get("spike_prob", 0.0), spike, seed)
        forward = sum(forward) / 2
    return RegionCost(
        forward=slowdown * forward / 1e3,
        backward_ratio=spec.get("backward_ratio", 2.0),
        input_grad_ratio=spec.get("input_grad_ratio", 1.0),
        output_bytes=size * spec.get("output_mb", 0) * _MB,
        input_bytes=size * spec.get("input_mb", 0) * _MB,
        stored_bytes=size * spec.get("stored_mb", 0) * _MB,
        param_bytes=spec.get("param_mb", 0) * _MB,
        jitter=jitter,
    )


def _link(spec: Mapping[str, Any]) -> Link:
    return Link(latency=spec.get("latency_us", 0) / 1e6, bandwidth=spec.get("gb_per_s", float("inf")) * 1e9)


def _need(mapping: Mapping[str, Any], *keys: str) -> Any:
    value: Any = mapping
    for i, key in enumerate(keys):
        if not isinstance(value, Mapping) or key not in value:
            raise ScheduleError(f"config: missing {'.'.join(keys[: i + 1])}")
        value = value[key]
    return value


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values)
