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
``decoupled``  FlowTrain's producer on ``encoder_ranks`` ranks of its own, through the pool.

``megatron`` takes ``layers: search``: every split with the ViT and ``k`` LLM layers on
stage 0 and the other LLM layers spread evenly is simulated and the fastest kept, so the
baseline gets its best split rather than a hand-picked one (the row names the split).

Every layout takes ``backbone``: the LLM's sharded skeleton, ``1f1b`` (default), ``zb-h1`` or
``zb-v`` (:mod:`.zero_bubble`), so ``{layout: transpose, backbone: zb-h1}`` is
``<transpose, zb-h1>``.  ``transpose`` and ``decoupled`` take ``encoder_in_flight``: the most microbatches whose
ViT activations one rank holds (see ``max_in_flight`` of the replicated skeletons).

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
from .skeletons import Decoupled, OneFOneB, Transpose
from .validate import validate
from .zero_bubble import ZeroBubbleH1, ZeroBubbleV

LAYOUTS = ("megatron", "disttrain", "transpose", "decoupled")
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
    throughput: float  # microbatches per second over the whole device budget
    speedup: float  # over the config's first schedule
    vs_disttrain: float | None  # over the config's disttrain schedule (Mpipe's own baseline)
    rendezvous: float  # mean step with blocking sends (compose's rendezvous programs)
    seeds: int  # simulated steps the means are over; charts draw the first (seed 0)
    split: tuple[int, ...] | None = None  # the megatron layout's layers per stage


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
        vit_skeleton = backbone(stages=schedule.get("encoder_stages", 1))
    elif layout == "transpose":
        vit_skeleton = Transpose(max_in_flight=schedule.get("encoder_in_flight"),
                                 order=schedule.get("transpose_order", "ready"),
                                 backward=schedule.get("transpose_backward", "owner"))
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
    full rank), the LLM on ``devices_per_rank``."""
    per_rank = _need(config, "devices_per_rank")
    devices = {ENCODER_REGION: schedule.get("encoder_devices_per_rank", per_rank)}
    regions = {
        name: _region_cost(spec, seed, spec.get("forward_devices", per_rank) / devices.get(name, per_rank))
        for name, spec in _need(config, "regions").items()
    }
    cv = _need(config, "packing_cv", schedule.get("packing", "unbalanced"))
    rng = random.Random(f"packs:{seed}")
    packs = [max(0.2, rng.gauss(1.0, cv)) for _ in range(_need(config, "num_microbatches"))]
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
    plan = compose(build_regions(config, schedule), _need(config, "num_microbatches"),
                   duration=nominal.compute_seconds, semantics=semantics)
    validate(plan)
    return plan


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
    per_rank = _need(config, "devices_per_rank")
    count = _need(config, "num_microbatches")
    seeds = config.get("seeds", 1)
    for entry in _need(config, "schedules"):
        name = _need(entry, "name")
        schedule = best_split(config, entry)
        plan = scenario_plan(config, schedule)
        results = _simulated(config, schedule, plan)
        blocking = _simulated(config, schedule, scenario_plan(config, schedule, "rendezvous"))
        if charts is not None:
            title = f"{config.get('name', '')} {name}, seed 0 of {seeds} (table: mean {_mean(r.step_time for r in results):.2f} s)"
            draw(results[0], charts / f"{name}.png", title)
        encoder_ranks = _encoder_ranks(plan)
        devices = per_rank * (len(plan.programs) - encoder_ranks) + encoder_ranks * schedule.get(
            "encoder_devices_per_rank", per_rank)
        step = _mean(r.step_time for r in results)
        throughput = count / step * _need(config, "devices") / devices
        rows.append(Row(
            name=name,
            layout=schedule["layout"],
            ranks=len(plan.programs),
            devices=devices,
            step=step,
            bubble=_mean(r.bubble_fraction for r in results),
            util_min=_mean(min(r.utilisation.values()) for r in results),
            util_max=_mean(max(r.utilisation.values()) for r in results),
            peak_gib=max(max(r.peak_bytes.values()) for r in results) / 2**30,
            throughput=throughput,
            speedup=throughput / rows[0].throughput if rows else 1.0,
            vs_disttrain=None,
            rendezvous=_mean(r.step_time for r in blocking),
            seeds=seeds,
            split=tuple(schedule["layers"]) if schedule["layout"] == "megatron" and "layers" in schedule else None,
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
    header = (f"{'schedule':<24} {'layout':<10} {'ranks':>5} {'dev':>4} {'step s':>8} {'rdv s':>7} "
              f"{'bubble':>7} {'util min-max':>13} {'peak act GiB':>12} {'mb/s':>8} {'speedup':>8} "
              f"{'vs dist':>8}")
    lines = [title, header, "-" * len(header)]
    for r in rows:
        versus = f"{r.vs_disttrain:>7.2f}x" if r.vs_disttrain is not None else f"{'-':>8}"
        lines.append(
            f"{r.name:<24} {r.layout:<10} {r.ranks:>5} {r.devices:>4} {r.step:>8.2f} {r.rendezvous:>7.2f} "
            f"{r.bubble:>7.1%} {r.util_min:>6.0%}-{r.util_max:<6.0%} {r.peak_gib:>12.1f} "
            f"{r.throughput:>8.1f} {r.speedup:>7.2f}x {versus}"
        )
    splits = [f"{r.name} layers {list(r.split)}" for r in rows if r.split]
    seeds = rows[0].seeds if rows else 0
    lines.append(f"means over {seeds} simulated steps (seeds 0..{seeds - 1}; each chart draws seed 0); "
                 "rdv: blocking sends; speedup: throughput per device over the first row, vs dist: "
                 "over the disttrain row" + (f"; {', '.join(splits)}" if splits else ""))
    return "\n".join(lines)


def _region_cost(spec: Mapping[str, Any], seed: int, slowdown: float) -> RegionCost:
    """A region's costs; ``slowdown`` scales its times (its devices' share of the reference)."""
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
        output_bytes=spec.get("output_mb", 0) * _MB,
        input_bytes=spec.get("input_mb", 0) * _MB,
        stored_bytes=spec.get("stored_mb", 0) * _MB,
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
