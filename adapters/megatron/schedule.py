"""Megatron's ``forward_backward_func`` served by the mindspeed-flow runtime.

:func:`flow_forward_backward` takes Megatron's keywords, reads the pipeline from
``parallel_state`` and runs this rank's program of the configured layout (default:
Megatron's own, 1F1B or interleaved by the length of the model list, so numbers do not
change).  It keeps Megatron's contract around the schedule too: the model config's
``no_sync_func`` holds gradient reduction back until each chunk's last backward, and
``finalize_model_grads_func`` runs at the end, with the token count of 3-value losses.
With several model chunks per rank (the interleaved schedule) the virtual pipeline rank is
set to each chunk's index before its forward and backward passes, as Megatron does, and put
back when the step ends.

The layout file is the config tree's ``schedule.config`` (``--flow-schedule-config`` on the
command line or in ``MINDSPEED_FLOW_FLAGS``, :func:`mindspeed_flow.activation.flow_config`),
never read from Megatron's ``args`` alone: the environment's value would be missing there.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mindspeed_flow.activation import flow_config
from mindspeed_flow.adapters.errors import ScheduleConflict
from mindspeed_flow.adapters.megatron.decoupled_layout import refuse_without_decoupled_step
from mindspeed_flow.runtime import Binding, Executor, LossRules, RuntimeOptions
from mindspeed_flow.runtime.layout import load_runtime_options, local_visits, megatron_layout, plan_for
from mindspeed_flow.schedule import Region
from mindspeed_flow.schedule.regions import ENCODER_REGION

log = logging.getLogger("mindspeed_flow.schedule")

MEGATRON_KEYWORDS = ("forward_step_func", "data_iterator", "model", "num_microbatches", "seq_length",
                     "micro_batch_size", "decoder_seq_length", "forward_only", "collect_non_loss_data",
                     "first_val_step")


@dataclass
class ScheduleSettings:
    """What the patch configured: a layout builder (pipeline size, chunks) -> regions
    (``None``: Megatron's own) and the runtime's options."""

    layout: Callable[[int, int], Sequence[Region]] | None = None
    options: RuntimeOptions = field(default_factory=RuntimeOptions)
    last_timeline: Any = None  # the measured timeline of the latest step
    _plans: dict = field(default_factory=dict, repr=False)
    _executors: dict = field(default_factory=dict, repr=False)
    _ignored: set = field(default_factory=set, repr=False)


SETTINGS = ScheduleSettings()


def configure(layout: Callable[[int, int], Sequence[Region]] | None = None,
              options: RuntimeOptions | None = None) -> ScheduleSettings:
    """Set the layout and options the patched ``get_forward_backward_func`` runs with."""
    global SETTINGS
    SETTINGS = ScheduleSettings(layout, options or RuntimeOptions())
    return SETTINGS


def flow_forward_backward(*, forward_step_func: Callable, data_iterator: Any, model: Any, num_microbatches: int,
                          seq_length: int | None = None, micro_batch_size: int | None = None,
                          decoder_seq_length: int | None = None, forward_only: bool = False,
                          collect_non_loss_data: bool = False, first_val_step: bool | None = None,
                          **newer: Any) -> list:
    """Megatron's ``forward_backward_func`` signature (0.12), run by our runtime.

    ``seq_length`` / ``micro_batch_size`` / ``decoder_seq_length`` are not needed: every
    transfer carries its shape.  Keywords of newer Megatron versions (``adjust_tensor_shapes_fn``,
    ``p2p_communicator``, ``pg_collection``...) are ignored, logged once each.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    for name in sorted(set(newer) - SETTINGS._ignored):
        log.warning("mindspeed-flow schedule: ignoring Megatron keyword %s=%r", name, newer[name])
        SETTINGS._ignored.add(name)
    models = list(model) if isinstance(model, list) else [model]
    iterators = list(data_iterator) if isinstance(data_iterator, list) else [data_iterator] * len(models)
    if len(iterators) != len(models):
        raise ValueError(f"{len(models)} model chunks but {len(iterators)} data iterators")
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    group = parallel_state.get_pipeline_model_parallel_group()
    ranks = dist.get_process_group_ranks(group)
    plan = _plan(stages, len(models), num_microbatches)
    visits = local_visits(plan, rank)
    if _transposed_vit(visits, models):
        bindings = _transposed_bindings(visits, models[0], iterators[0])
    else:
        if len(visits) != len(models):
            raise ValueError(f"the schedule layout puts {len(visits)} chunks {visits} on pipeline rank {rank}, "
                             f"but the model list has {len(models)}")
        # Megatron's interleaved schedule sets the virtual pipeline rank to the chunk's index before
        # each of its forwards and backwards (Float16Module, is_pipeline_first/last_stage read it);
        # MindSpeed-MM leaves it at the last chunk after building the data iterators.
        enter = [None] * len(models) if len(models) == 1 else [
            functools.partial(parallel_state.set_virtual_pipeline_model_parallel_rank, i) for i in range(len(models))]
        bindings = {v: Binding(m, it, e) for v, m, it, e in zip(visits, models, iterators, enter)}
    key = tuple(ranks)
    executor = SETTINGS._executors.get(key)
    if executor is None:
        executor = SETTINGS._executors[key] = Executor(rank, ranks, group, options=SETTINGS.options)
    config = get_model_config(models[0])
    loss = LossRules(config.calculate_per_token_loss, parallel_state.get_context_parallel_world_size(),
                     config.grad_scale_func)
    virtual_rank = parallel_state.get_virtual_pipeline_model_parallel_rank()
    try:
        with _grad_sync_held(config, forward_only) as release:
            result = executor.run(plan, forward_step_func, bindings, forward_only=forward_only,
                                  collect_non_loss_data=collect_non_loss_data, loss=loss,
                                  before_last_backward=release)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_rank(virtual_rank)
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(
            models, result.total_num_tokens if config.calculate_per_token_loss else None)
    SETTINGS.last_timeline = result.timeline
    return result.forward_data_store


def _plan(stages: int, chunks: int, num_microbatches: int):
    key = (stages, chunks, num_microbatches)
    plan = SETTINGS._plans.get(key)
    if plan is None:
        regions = (SETTINGS.layout or megatron_layout)(stages, chunks)
        plan = SETTINGS._plans[key] = plan_for(regions, num_microbatches)
    return plan


def _transposed_vit(visits: list, models: list) -> bool:
    """This rank runs the transposed ViT beside its one LLM chunk (``vlm: {transpose: true}``)."""
    return (getattr(SETTINGS.layout, "transpose", False) and len(models) == 1 and len(visits) == 2
            and visits[0][0] == ENCODER_REGION)


def _transposed_bindings(visits: list, chunk: Any, iterator: Any) -> dict:
    """``('vit', 0)``: the chunk's ViT replica alone; ``('llm', s)``: the chunk, which takes the
    ViT's embeddings as its input tensor.  Both read the rank's one data iterator (the
    runtime hands each visit its own microbatch of it)."""
    from mindspeed_flow.adapters.mindspeed_mm.transpose import vit_stage

    (vit, llm) = visits
    return {vit: Binding(vit_stage(chunk), iterator), llm: Binding(chunk, iterator)}


@contextlib.contextmanager
def _grad_sync_held(config: Any, forward_only: bool):
    """Megatron's ``disable_grad_sync`` / ``enable_grad_sync``: gradient reduction (DDP's
    ``no_sync``) is held back until a chunk's last backward, then released for it."""
    funcs = config.no_sync_func
    if funcs is None or forward_only:
        yield None
        return
    funcs = list(funcs) if isinstance(funcs, (list, tuple)) else [funcs]
    contexts = [f() for f in funcs]
    for c in contexts:
        c.__enter__()
    open_ = list(range(len(contexts)))

    def release(chunk: int | None) -> None:
        if (chunk is None) == (len(contexts) > 1):
            return  # one context: released at the rank's last backward; one per chunk: at each's
        which = chunk or 0
        if which in open_:
            open_.remove(which)
            contexts[which].__exit__(None, None, None)

    try:
        yield release
    finally:
        for i in list(open_):
            contexts[i].__exit__(None, None, None)


# --------------------------------------------------------------------------- the patch

# (feature of another patch set that swaps the same schedule, how to see it in ``args``)
CONFLICTS: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("MindSpeed DualPipeV (--schedules-method dualpipev)",
     lambda a: getattr(a, "schedules_method", None) == "dualpipev"),
    ("MindSpeed RiPipe (--recompute-in-bubble / --recompute-in-advance)",
     lambda a: bool(getattr(a, "recompute_in_bubble", False) or getattr(a, "recompute_in_advance", False))),
    ("MindSpeed-MM --hetero-parallel (its own get_forward_backward_func)",
     lambda a: bool(getattr(a, "hetero_parallel", False))),
    # MindSpeed features that register their own schedules.get_forward_backward_func too
    ("MindSpeed --optimize-send-recv-comm", lambda a: bool(getattr(a, "optimize_send_recv_comm", False))),
    ("MindSpeed --use-multiparameter-pipeline-model-parallel",
     lambda a: bool(getattr(a, "use_multiparameter_pipeline_model_parallel", False))),
    ("MindSpeed --dist-train", lambda a: bool(getattr(a, "dist_train", False))),
    ("MindSpeed --moe-fb-overlap (with virtual pipeline stages, a pipeline layout or PP=1)",
     lambda a: bool(getattr(a, "moe_fb_overlap", False)) and bool(
         getattr(a, "virtual_pipeline_model_parallel_size", None) or getattr(a, "pipeline_model_parallel_layout", None)
         or getattr(a, "num_layers_per_virtual_pipeline_stage", None)
         or int(getattr(a, "pipeline_model_parallel_size", 1) or 1) == 1)),
    ("MindSpeed-MM layerwise_disaggregated_training",
     lambda a: bool(getattr(a, "layerwise_disaggregated_training", False))),
)
FEATURE = "mindspeed-flow schedule (--flow-schedule)"


# Features of other patch sets that patch what our runtime never calls: composed, logged once.
BYPASSED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("MindSpeed --variable-seq-lengths", lambda a: bool(getattr(a, "variable_seq_lengths", False)),
     "our runtime sends a shape header with every tensor itself and never calls Megatron's "
     "p2p_communication, so MindSpeed's _communicate/_communicate_shapes patch is bypassed"),
)


def check_conflicts(args: Any) -> None:
    """Refuse to start when a feature that replaces the same functions is on; say which
    features compose because what they patch is not on our runtime's path."""
    active = [name for name, is_on in CONFLICTS if is_on(args)]
    if active:
        raise ScheduleConflict(
            f"{FEATURE} cannot run together with {', '.join(active)}: both replace Megatron's "
            "pipeline schedule; turn one of them off")
    if not runtime_runs(args):
        if getattr(args, "rank", 0) == 0:
            log.info("%s: one pipeline stage and no --flow-schedule-config: Megatron's own "
                     "forward_backward_no_pipelining runs each step, not the plugin's runtime", FEATURE)
        return  # nothing of ours is on the path, so nothing of another feature is bypassed
    for name, is_on, why in BYPASSED:
        if is_on(args):
            log.warning("%s with %s: %s", FEATURE, name, why)


def layout_path(args: Any) -> str | None:
    """``--flow-schedule-config`` as the config tree holds it (checked against ``args``)."""
    return flow_config(args).schedule.config


def runtime_runs(args: Any) -> bool:
    """Whether our runtime serves the step: a layout is named, or there is more than one
    pipeline stage (:func:`get_forward_backward_func_wrapper` hands back Megatron's own
    function otherwise)."""
    return bool(layout_path(args)) or int(getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1


def layout_from_args(args: Any) -> Callable[[int, int], Sequence[Region]] | None:
    """The layout ``--flow-schedule-config`` names (``None``: Megatron's own).  A file with
    ``vlm: {transpose: true, ...}`` instead of ``regions:`` derives it from MindSpeed-MM's
    ``vision_encoder`` / ``text_decoder`` ``pipeline_num_layers``, read when the schedule is
    first built: MindSpeed-MM merges its model config into ``args`` (``merge_mm_args``) only
    after Megatron validated the arguments.  A ``decoupled:`` file is no layout of this
    schedule (``None``): the ``pool`` feature's decoupled step runs it."""
    path = layout_path(args)
    if not path:
        return None
    from mindspeed_flow.runtime.layout import load_layout, vlm_layout
    from mindspeed_flow.schedule import ScheduleError
    from mindspeed_flow.typed_yaml import read_yaml

    doc = read_yaml(path, error=ScheduleError, what="the schedule layout") or {}
    if isinstance(doc, dict) and "decoupled" in doc:
        return None  # the pool feature's decoupled step runs it (patches/pool.py)
    if not (isinstance(doc, dict) and "vlm" in doc):
        return lambda stages, chunks: load_layout(path, stages)
    options = dict(doc["vlm"] or {})

    def from_mindspeed_mm(stages: int, chunks: int) -> Sequence[Region]:
        model = getattr(getattr(args, "mm", None), "model", None)
        try:
            vision = model.image_encoder.vision_encoder.pipeline_num_layers
            text = model.text_decoder.pipeline_num_layers
        except AttributeError:
            raise ValueError(f"{path}: `vlm:` needs MindSpeed-MM's model config (args.mm.model with "
                             "image_encoder.vision_encoder and text_decoder pipeline_num_layers)") from None
        chosen = dict(options)
        if chosen.get("transpose"):
            _vision_trainable_from_model(chosen, model.image_encoder, path)
        try:
            return vlm_layout(vision, text, **chosen)
        except TypeError as exc:
            raise ValueError(f"{path}: vlm: {exc}") from None

    from_mindspeed_mm.deferred = True  # type: ignore[attr-defined]
    from_mindspeed_mm.transpose = bool(options.get("transpose"))  # type: ignore[attr-defined]
    return from_mindspeed_mm


def _vision_trainable_from_model(options: dict, image_config: Any, path: str) -> None:
    """The transposed ViT region trains when MindSpeed-MM trains any ViT part
    (``vision_encoder.freeze`` / ``vision_projector.freeze``); a ``vision_trainable`` in the
    file that says otherwise is refused."""
    from mindspeed_flow.adapters.mindspeed_mm.transpose import vision_trainable

    trainable = vision_trainable(image_config)
    given = options.setdefault("vision_trainable", trainable)
    if bool(given) != trainable:
        raise ValueError(f"{path}: vlm: vision_trainable: {given} but MindSpeed-MM's model config "
                         f"{'trains' if trainable else 'freezes'} the ViT (vision_encoder.freeze / "
                         "vision_projector.freeze); leave vision_trainable out or make them agree")


def options_from_args(args: Any) -> RuntimeOptions | None:
    """The ``runtime:`` section of ``--flow-schedule-config`` (:func:`~mindspeed_flow.runtime.layout.load_runtime_options`),
    or ``None`` without a layout file or without that section."""
    path = layout_path(args)
    return load_runtime_options(path) if path else None


def validate_args_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """After Megatron validated its arguments: refuse conflicting features, load the layout
    (so a bad file fails at start-up, naming itself)."""
    result = wrapped(*args, **kwargs)
    parsed = args[0] if args else kwargs.get("args")
    check_conflicts(parsed)
    refuse_without_decoupled_step(parsed)  # a decoupled file without the pool feature: never co-located
    layout = layout_from_args(parsed)
    if layout is not None and not getattr(layout, "deferred", False):
        stages = getattr(parsed, "pipeline_model_parallel_size", 1) or 1
        layout(stages, 1)
    configure(layout, options_from_args(parsed) or SETTINGS.options)
    return result


def get_forward_backward_func_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Callable:
    """Our runtime instead of Megatron's schedule; Megatron's own when there is nothing to
    schedule (one pipeline stage and no layout configured)."""
    from megatron.core import parallel_state

    if SETTINGS.layout is None and parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return wrapped(*args, **kwargs)
    return flow_forward_backward
