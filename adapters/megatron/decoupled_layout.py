"""The decoupled layout a Megatron / MindSpeed-MM job's flags choose, read once at start-up.

Two flags can name one: ``--flow-schedule-config`` with the file's ``decoupled:`` form
(:func:`mindspeed_flow.runtime.layout.load_decoupled`) and ``--flow-allocator-plan`` with a
decoupled plan (:func:`mindspeed_flow.decoupled.layout_from_plan`: exactly the layout of
the plan's sizes), both read from the config tree (:func:`mindspeed_flow.activation.flow_config`).
:func:`decoupled_layout` is the one function the real job's start-up calls: it gives the
:class:`~mindspeed_flow.decoupled.DecoupledLayout` (sizes only; the model's layer counts
are added with ``with_layers``) or ``None``, and refuses a world size that is not the
layout's, naming both numbers.

A decoupled layout runs only where the ``pool`` feature's patches are enabled (encoder
ranks building the ViT, two parallel configs, the pool); :func:`refuse_without_decoupled_step`
refuses the job at start-up otherwise, so it never runs co-located without a word.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from mindspeed_flow.activation import current_registry, flow_config
from mindspeed_flow.decoupled import DecoupledLayout, LayoutError, layout_from_plan

DECOUPLED_FEATURE = "pool"  # patches/pool.py's feature: the decoupled layout's patches


def decoupled_layout(args: Any) -> DecoupledLayout | None:
    """The layout ``args``' flags name (``None``: none does).  When the layout file and the
    allocator plan both name one they must be the same sizes (the file's ``max_in_flight``
    and ``flow*`` keys win: a plan has none of them); ``args.world_size`` must be the layout's, and a
    layout with ``flow`` one that the flow runs (:func:`~.decoupled_flow.check_supported`)."""
    chosen = _chosen(args)
    return chosen[1] if chosen else None


def _chosen(args: Any) -> tuple[str, DecoupledLayout] | None:
    """``(where it came from, the layout)`` of :func:`decoupled_layout`."""
    config = flow_config(args)
    found = _named(config)
    if not found:
        return None
    source, layout = found[0]
    if len(found) == 2 and replace(found[1][1], max_ahead=layout.max_ahead, flow=layout.flow,
                                   flow_encoder_batch_patches=layout.flow_encoder_batch_patches,
                                   flow_encoder_cost=layout.flow_encoder_cost,
                                   flow_max_in_flight=layout.flow_max_in_flight,
                                   flow_repack=layout.flow_repack) != layout:
        raise LayoutError(f"{source} and {found[1][0]} name two decoupled layouts: {describe_sizes(layout)} and "
                          f"{describe_sizes(found[1][1])}; give one, or make them agree")
    world = getattr(args, "world_size", None)
    if world is not None:
        layout.check_world_size(int(world), source)
    if layout.flow:
        from mindspeed_flow.adapters.megatron.decoupled_flow import check_supported

        check_supported(layout, args, source, backend=config.pool_backend)
    return source, layout


def _named(config: Any) -> list[tuple[str, DecoupledLayout]]:
    """Each decoupled layout the config tree names, with its file: the layout file's, then the plan's."""
    from mindspeed_flow.allocator.plan import DECOUPLED, AllocationPlan
    from mindspeed_flow.runtime.layout import load_decoupled

    found: list[tuple[str, DecoupledLayout]] = []
    if config.schedule.config:
        from_file = load_decoupled(config.schedule.config)
        if from_file is not None:
            found.append((str(config.schedule.config), from_file))
    if config.enabled("allocator") and config.allocator.plan:
        plan = AllocationPlan.load(config.allocator.plan)
        if plan.placement == DECOUPLED:
            try:
                found.append((str(config.allocator.plan), layout_from_plan(plan)))
            except LayoutError as exc:
                raise LayoutError(f"{config.allocator.plan}: {exc}") from None
    return found


def describe_sizes(layout: DecoupledLayout) -> str:
    """The layout's sizes in the words of the job's log and its errors."""
    return (f"encoder dp {layout.encoder_dp * layout.backbone_dp} x tp {layout.encoder_tp}, backbone dp "
            f"{layout.backbone_dp} x tp {layout.backbone_tp} x pp {layout.backbone_pp}")


def decoupled_step_installed() -> bool:
    """Whether this process's patch registry has the ``pool`` feature (the decoupled layout's patches) on."""
    registry = current_registry()
    return registry is not None and DECOUPLED_FEATURE in registry.enabled


def refuse_without_decoupled_step(args: Any) -> None:
    """Refuse (:class:`LayoutError`, naming where it came from) a decoupled layout the flags
    name when the ``pool`` feature's patches are not on in this process (they check the
    layout themselves when they are)."""
    if decoupled_step_installed():
        return
    chosen = _chosen(args)
    if chosen is None:
        return
    source, layout = chosen
    raise LayoutError(
        f"{source}: a decoupled layout ({describe_sizes(layout)}, {layout.world_size} ranks) needs the plugin's "
        f"`{DECOUPLED_FEATURE}` feature (encoder ranks of their own, two parallel configs, the pool), which is "
        "not on in this job, and would otherwise run co-located; add --flow-pool (or --use-flowtrain), or "
        "drop the decoupled layout")
