"""An allocator plan as a decoupled layout: the one mapping that ``mindspeed-flow train``
and the real job's ``--flow-allocator-plan`` both use.

The allocator counts the encoder's replicas over the whole job (``encoder.dp``); a
:class:`~.layout.DecoupledLayout` counts them per backbone replica (``encoder_dp``), so a
plan maps to a layout when its encoder replicas split evenly over its backbone replicas.
The plan carries no in-flight limit: the caller passes its own (``max_ahead``).
"""

from __future__ import annotations

from typing import Any

from .errors import LayoutError
from .layout import DecoupledLayout

_DEFAULT_MAX_AHEAD = DecoupledLayout.__dataclass_fields__["max_ahead"].default


def layout_from_plan(plan: Any, *, max_ahead: int | None = _DEFAULT_MAX_AHEAD) -> DecoupledLayout:
    """The :class:`DecoupledLayout` that runs ``plan`` (an ``AllocationPlan``); refuses
    (:class:`LayoutError`) a co-located plan and an encoder that does not split over the
    backbone replicas.  Layer counts are the layout's defaults (:meth:`DecoupledLayout.with_layers`)."""
    from ..allocator.plan import DECOUPLED

    b, e = plan.backbone, plan.encoder
    if plan.placement != DECOUPLED:
        raise LayoutError("the allocator's plan is co-located (ViT inside stage 0), not a decoupled layout")
    if e.dp % b.dp:
        raise LayoutError(f"the plan's {e.dp} encoder replicas do not split over its {b.dp} backbone replicas")
    return DecoupledLayout(encoder_dp=e.dp // b.dp, encoder_tp=e.tp, backbone_pp=b.pp, backbone_tp=b.tp,
                           backbone_dp=b.dp, max_ahead=max_ahead)


def unrealisable(plan: Any, world_size: int, *, tensor_parallel: bool = False,
                 megatron_blocks: bool = True) -> str:
    """Why a decoupled layout of ``world_size`` ranks cannot run ``plan`` (``""`` when it
    can): not decoupled, an encoder that does not split, another device count, tensor
    parallelism where the runner has none (``tensor_parallel=False``: the CPU run), or
    encoder ranks that split Megatron's ``tp x pp`` blocks (``megatron_blocks``: a runner that
    builds Megatron's groups in one call, as ``mindspeed-flow train`` does)."""
    try:
        layout = layout_from_plan(plan)
    except LayoutError as exc:
        return str(exc)
    if not tensor_parallel and (plan.encoder.tp != 1 or plan.backbone.tp != 1):
        return "the allocator's plan uses tensor parallelism, which the CPU run does not"
    if plan.devices != world_size:
        return f"the plan uses {plan.devices} of the {world_size} ranks"
    if megatron_blocks:
        try:
            layout.megatron_parallel_kwargs()
        except LayoutError as exc:
            return str(exc)
    return ""


def describe_plan(plan: Any) -> str:
    """One line per allocator plan: its shape and what the allocator predicted, so a reader
    sees why it was (or was not) the run's layout."""
    e, b, p = plan.encoder, plan.backbone, plan.predicted
    return (f"{plan.placement}: encoder dp={e.dp} tp={e.tp}; backbone pp={b.pp} dp={b.dp} tp={b.tp} "
            f"layers {list(b.layer_split)}; predicted {p.throughput:.3g} samples/s, bubble {p.bubble_fraction:.0%}")
