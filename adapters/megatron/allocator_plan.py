"""Applying an allocator plan to upstream at initialisation.

Megatron: the backbone's parallel sizes and batch go into ``args`` just before Megatron's
``validate_args`` derives everything else from them (data parallel size, microbatches),
so the job is validated as if the flags had been given.  MindSpeed-MM: once
``merge_mm_args`` has read the model JSON into ``args.mm.model``, the per-module layer
splits (``pipeline_num_layers`` of ``image_encoder.vision_encoder`` and ``text_decoder``)
and the encoder's own ``tensor_model_parallel_size`` (read by ``--hetero-parallel``) are
set there.

The plan comes from ``--flow-allocator-plan`` (command line, or ``MINDSPEED_FLOW_FLAGS``), as
the config tree holds it (:func:`mindspeed_flow.activation.flow_config`).
A co-located plan (the encoder inside the backbone's stage 0, upstream's own layout) is
applied.  A decoupled plan (the encoder on devices of its own, feeding the backbone through
the pool) is exactly a :class:`~mindspeed_flow.decoupled.DecoupledLayout`
(:func:`.decoupled_layout.decoupled_layout`); it runs only where the ``decoupled`` feature's
patches are on, and is refused at start-up with the reason otherwise (applying its backbone
sizes alone would run, without a word, another plan than the one the allocator chose).
With that feature the job's world must be the plan's devices (both numbers named otherwise)
and the roles' patches give each rank its role's sizes.  A plan that cannot fit the job
fails at start-up with both numbers named: a world size other than its devices, or a layer
count that is not the plan's.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable

from mindspeed_flow.allocator.errors import AllocatorError
from mindspeed_flow.allocator.plan import COLOCATED, AllocationPlan
from mindspeed_flow.allocator.upstream import megatron_split_settings, mindspeed_mm_model
from mindspeed_flow.activation import flow_config
from mindspeed_flow.adapters.megatron.decoupled_layout import decoupled_step_installed, refuse_without_decoupled_step
from mindspeed_flow.decoupled import LayoutError, layout_from_plan

log = logging.getLogger(__name__)


def plan_path(namespace: argparse.Namespace) -> str:
    path = flow_config(namespace).allocator.plan
    if not path:
        raise AllocatorError("--flow-allocator is on but no plan was given: add --flow-allocator-plan PLAN.yaml "
                             "(write one with `mindspeed-flow plan CONFIG --out PLAN.yaml`)")
    return path


def refuse_decoupled(plan: AllocationPlan, where: str, world: int | None = None) -> None:
    """A decoupled plan is refused, naming why and what to plan instead (its best co-located
    alternative when the file holds one)."""
    if plan.placement == COLOCATED or decoupled_step_installed():
        return
    enc, bb = plan.encoder, plan.backbone
    job = f" (this job: world size {world})" if world is not None else ""
    colocated = [a for a in plan.alternatives if a.placement == COLOCATED]
    instead = "plan the job with `placements: [colocated]` in the allocator config's workload"
    if colocated:
        a = colocated[0].backbone
        instead += (f"; this plan's best co-located alternative: backbone dp {a.dp} x tp {a.tp} x pp {a.pp}, "
                    f"micro batch {a.micro_batch}, {a.devices} devices")
    raise AllocatorError(
        f"{where}: refusing a decoupled plan: its encoder runs on {enc.devices} devices of its own "
        f"(dp {enc.dp} x tp {enc.tp}) and feeds the backbone (dp {bb.dp} x tp {bb.tp} x pp {bb.pp}, "
        f"{bb.devices} devices) through the memory pool, {plan.devices} devices in all{job}; that layout runs "
        f"in `mindspeed-flow train`, and in a Megatron / MindSpeed-MM job only with the plugin's `pool` "
        f"feature (--flow-pool or --use-flowtrain), which is not on: this job runs the encoder inside the backbone's stage 0 (co-located), so applying the backbone's sizes alone would run another "
        f"plan than the allocator chose; {instead}")


def megatron_settings(plan: AllocationPlan, namespace: argparse.Namespace, where: str) -> dict[str, Any]:
    """The ``args`` attributes the plan sets; checks the plan against the job first."""
    bb = plan.backbone
    world = getattr(namespace, "world_size", None)
    refuse_decoupled(plan, where, world)
    if plan.placement != COLOCATED and world is not None:
        try:
            layout_from_plan(plan).check_world_size(world, where)
        except LayoutError as exc:
            raise AllocatorError(str(exc)) from None
    elif world is not None and world != bb.devices:
        raise AllocatorError(
            f"{where}: the plan's backbone needs {bb.devices} devices (dp {bb.dp} x tp {bb.tp} x pp {bb.pp}) but "
            f"this job has world size {world}")
    layers = getattr(namespace, "num_layers", None)
    if layers is not None and layers != sum(bb.layer_split):
        raise AllocatorError(f"{where}: the plan splits {sum(bb.layer_split)} backbone layers "
                             f"{list(bb.layer_split)}, but --num-layers is {layers}")
    settings: dict[str, Any] = {
        "tensor_model_parallel_size": bb.tp,
        "pipeline_model_parallel_size": bb.pp,
        "micro_batch_size": bb.micro_batch,
        "global_batch_size": plan.global_batch,
        "sequence_parallel": bb.tp > 1,
    }
    try:
        settings.update(megatron_split_settings(bb.layer_split))
    except AllocatorError as exc:
        raise AllocatorError(f"{where}: {exc}") from None
    return settings


def apply_to_megatron_args(namespace: argparse.Namespace) -> AllocationPlan:
    """Load the plan named by the flags and write its sizes into Megatron's ``args``."""
    path = plan_path(namespace)
    plan = AllocationPlan.load(path)
    for name, value in megatron_settings(plan, namespace, path).items():
        before = getattr(namespace, name, None)
        setattr(namespace, name, value)
        if before != value and getattr(namespace, "rank", 0) == 0:
            log.info("mindspeed-flow allocator: %s %s -> %s (%s)", name, before, value, path)
    return plan


def validate_args_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``validate_args(args, defaults={})`` with the plan's sizes written in first.  Without
    the ``pool`` feature a decoupled plan is refused there (:func:`refuse_decoupled`),
    and so is a decoupled layout file (:func:`.decoupled_layout.refuse_without_decoupled_step`)."""
    namespace = args[0] if args else kwargs["args"]
    apply_to_megatron_args(namespace)
    refuse_without_decoupled_step(namespace)
    return wrapped(*args, **kwargs)


def _section(node: Any, dotted: str, where: str) -> Any:
    for key in dotted.split("."):
        node = getattr(node, key, None)
        if node is None:
            raise AllocatorError(f"{where}: the MindSpeed-MM model config has no {dotted} (--mm-model)")
    return node


def apply_to_mm_model(model: Any, plan: AllocationPlan, where: str) -> None:
    """Write the plan's per-module entries into MindSpeed-MM's model config object."""
    refuse_decoupled(plan, where)
    wanted = mindspeed_mm_model(plan)
    encoder = _section(model, "image_encoder.vision_encoder", where)
    if getattr(encoder, "num_layers", plan.encoder.layers) != plan.encoder.layers:
        raise AllocatorError(f"{where}: the plan's encoder has {plan.encoder.layers} layers, the vision encoder "
                             f"config has {encoder.num_layers}")
    for key, value in wanted["image_encoder"]["vision_encoder"].items():
        setattr(encoder, key, value)
    _section(model, "text_decoder", where).pipeline_num_layers = wanted["text_decoder"]["pipeline_num_layers"]


def merge_mm_args_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``merge_mm_args(args)``, then the plan's splits into ``args.mm.model``."""
    result = wrapped(*args, **kwargs)
    namespace = args[0] if args else kwargs["args"]
    path = plan_path(namespace)
    apply_to_mm_model(namespace.mm.model, AllocationPlan.load(path), path)
    return result
