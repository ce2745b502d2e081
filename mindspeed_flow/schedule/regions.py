"""Regions: contiguous layer ranges of the model, each with a skeleton and a trainable bit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .errors import ScheduleError
from .skeletons import Skeleton

# The region names the project's layouts use, defined once: MindSpeed-MM's VLM split into
# its vision encoder and its language model (:func:`.runtime.layout.vlm_layout`, the
# decoupled layout, the scenarios), and Megatron's own layout as one region.
ENCODER_REGION = "vit"
BACKBONE_REGION = "llm"
MEGATRON_REGION = "model"


@dataclass(frozen=True)
class Region:
    """A contiguous run of layers scheduled by one skeleton.

    Attributes:
        name: unique name, used in actions and cost tables.
        num_layers: layers in the region.
        skeleton: how the region is laid out and ordered.
        trainable: whether its weights get gradients.  A frozen region still runs an
            input-gradient backward when a trainable region lies before it (the gradient
            must pass through), and runs no backward at all otherwise.
        start: first layer index; ``None`` means "right after the previous region".  Given
            explicitly, it lets :func:`check_cover` catch gaps and overlaps.
    """

    name: str
    num_layers: int
    skeleton: Skeleton
    trainable: bool = True
    start: int | None = None


def check_cover(regions: Sequence[Region], num_layers: int | None = None) -> None:
    """Raise unless the regions cut ``[0, num_layers)`` into contiguous, disjoint parts."""
    if not regions:
        raise ScheduleError("no regions: a model needs at least one")
    names = [r.name for r in regions]
    for name in names:
        if names.count(name) > 1:
            raise ScheduleError(f"region name {name!r} is used twice")
    cursor = 0
    for region in regions:
        if region.num_layers < 1:
            raise ScheduleError(f"region {region.name!r} has {region.num_layers} layers")
        start = cursor if region.start is None else region.start
        if start > cursor:
            raise ScheduleError(
                f"gap before region {region.name!r}: layers {cursor}..{start - 1} are in no region"
            )
        if start < cursor:
            raise ScheduleError(
                f"region {region.name!r} overlaps the previous one: "
                f"layers {start}..{cursor - 1} are in two regions"
            )
        cursor = start + region.num_layers
    if num_layers is not None and cursor != num_layers:
        raise ScheduleError(
            f"regions cover layers 0..{cursor - 1} but the model has {num_layers} layers"
        )


def backward_kinds(regions: Sequence[Region]) -> dict[str, str | None]:
    """Per region, the backward actions of one visit, as their kind letters: "B"
    (trainable), "IW" (trainable under a skeleton that splits the backward: input gradients,
    later weight gradients), "I" (frozen, on the gradient path) or None (no backward).

    Gradients flow from the loss back to the first trainable region, so a region needs a
    backward pass exactly when it or some region before it is trainable.
    """
    kinds: dict[str, str | None] = {}
    seen_trainable = False
    for region in regions:
        seen_trainable = seen_trainable or region.trainable
        if region.trainable:
            kinds[region.name] = "IW" if region.skeleton.splits_backward else "B"
        else:
            kinds[region.name] = "I" if seen_trainable else None
    return kinds
