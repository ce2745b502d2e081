"""The transposed ViT (``<transpose, 1f1b>``) in MindSpeed-MM's own job.

Under ``--flow-schedule-config`` with ``vlm: {transpose: true}`` the runtime runs the whole
ViT (encoder + projector) of microbatch ``m`` on pipeline rank ``m % PP`` and the LLM as
Megatron's 1F1B.  MindSpeed-MM builds the ViT on the stages ``vision_encoder.pipeline_num_layers``
gives it layers to, so the wrappers here make the model the schedule needs:

* :func:`vlm_init_wrapper` (``VLMModel.__init__``): on every pipeline rank the ViT is a
  submodule named ``image_encoder`` (stage 0: the one MindSpeed-MM built; stages > 0: one
  built as stage 0 builds it, the pipeline rank seen as 0 during that build), frozen as
  MindSpeed-MM's config says (``vision_encoder.freeze``, default True;
  ``vision_projector.freeze``, default False: what ``pretrain_vlm._apply_freezing`` reads).
  ``add_image_encoder`` is then False on every stage, so the LLM chunk never runs the ViT:
  ``VLMModel.forward`` takes the embeddings the runtime hands it (``set_input_tensor``).
  Replica parameters on stages > 0 are marked ``shared`` (as Megatron marks a tied
  embedding's second copy), so the gradient norm and zero count count the ViT once.
  Being submodules, the replicas go through Megatron's DDP, optimizer, loss scaling and
  checkpoints (each stage's file holds its replica under the stage-0 names ``image_encoder.*``).
* :func:`get_model_wrapper` (``megatron.training.training.get_model``): after DDP wrapped the
  chunks and before any optimizer copies them, the replicas take stage 0's parameters (one
  broadcast over the pipeline group).  From then on they stay equal without further
  broadcasts: a frozen ViT never changes, a trainable one gets the replicas' summed
  gradients (the plan's ``REDUCE``, on DDP's ``main_grad``) on every rank, so every rank's
  optimizer step is the same.  The plan of a trainable ViT still starts each step with its
  ``BCAST`` (the plan's validation requires one before a trainable replica's first forward):
  it rewrites equal values, one flat broadcast per step; a frozen ViT's plan has none.
* :class:`VitStage`: what the plan's ``('vit', 0)`` visit is bound to: ``forward_step(it, model)``
  calls ``model(**batch)`` and reads ``model.module.module.add_image_encoder`` /
  ``.image_encoder.post_process`` (DDP -> Float16Module -> VLMModel); this view runs only the
  ViT replica on the batch and returns its ``[-1, 1, H]`` embeddings; its ``parameters()``
  are the replica's (the runtime's ``REDUCE`` packs those).

What cannot work is refused when the model is built (:class:`TransposeUnsupported`).
Nothing upstream is imported at module level.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import torch

from mindspeed_flow.adapters.errors import TransposeUnsupported

REPLICA_ATTRIBUTE = "_flow_vit_replica"  # set on VLMModel instances built for the transposed layout


def transposed() -> bool:
    """Whether the configured schedule layout transposes the ViT (``vlm: {transpose: true}``)."""
    from mindspeed_flow.adapters.megatron.schedule import SETTINGS

    return bool(getattr(SETTINGS.layout, "transpose", False))


def vision_freezing(image_config: Any) -> tuple[bool, bool]:
    """(encoder frozen, projector frozen) as ``pretrain_vlm._apply_freezing`` reads them
    (a part the config does not have counts as frozen: it has nothing to train)."""
    encoder = getattr(image_config, "vision_encoder", None)
    projector = getattr(image_config, "vision_projector", None)
    return (encoder is None or bool(getattr(encoder, "freeze", True)),
            projector is None or bool(getattr(projector, "freeze", False)))


def vision_trainable(image_config: Any) -> bool:
    """Whether any ViT part trains: the plan's ViT region is then trainable (backward, REDUCE)."""
    encoder, projector = vision_freezing(image_config)
    return not (encoder and projector)


def check_supported(args: Any, vision_layers: list, pp_size: int, vpp: bool, trainable: bool) -> None:
    """Refuse what the transposed layout cannot run, naming the setting."""
    if trainable and getattr(args, "overlap_grad_reduce", False):
        raise TransposeUnsupported(
            "vlm: {transpose: true} with a trainable ViT and --overlap-grad-reduce: the plan's REDUCE of the "
            "replicas' gradients reads and writes DDP's buffers after the last backward, where an overlapped "
            "all-reduce may still be writing them; drop --overlap-grad-reduce or freeze the ViT")
    if vpp:
        raise TransposeUnsupported(
            "vlm: {transpose: true} with virtual pipeline stages: the transposed ViT runs beside a "
            "1F1B text decoder of one chunk per rank; drop --virtual-pipeline-model-parallel-size "
            "(--num-layers-per-virtual-pipeline-stage)")
    if any(isinstance(n, (list, tuple)) for n in vision_layers):
        raise TransposeUnsupported(
            f"vlm: {{transpose: true}}: vision_encoder.pipeline_num_layers {vision_layers} is per virtual stage")
    if len(vision_layers) != pp_size or any(vision_layers[1:]) or not vision_layers[0]:
        raise TransposeUnsupported(
            f"vlm: {{transpose: true}} needs the whole ViT on stage 0 in vision_encoder.pipeline_num_layers "
            f"(one entry per pipeline stage, [N, 0, ...]), got {vision_layers} at pipeline size {pp_size}: "
            "every rank then builds a replica of that stage-0 ViT")
    for flag in ("use_data_balance", "encoder_dp_balance", "hetero_parallel"):
        if getattr(args, flag, False):
            raise TransposeUnsupported(
                f"vlm: {{transpose: true}} with --{flag.replace('_', '-')}: it moves images between ranks "
                "around the ViT, which the transposed layout runs on other ranks than MindSpeed-MM's")


@contextlib.contextmanager
def pipeline_rank_zero() -> Iterator[None]:
    """Megatron's pipeline rank read as 0: MindSpeed-MM's ViT reads it when built (its
    layers) and in every forward (``fullatt_block_indexes`` are shifted by the layers of the
    stages before it), so a replica is built and run as stage 0's ViT."""
    from megatron.core import parallel_state

    saved = parallel_state._MPU_PIPELINE_MODEL_PARALLEL_RANK
    parallel_state.set_pipeline_model_parallel_rank(0)
    try:
        yield
    finally:
        parallel_state.set_pipeline_model_parallel_rank(saved)


@contextlib.contextmanager
def _as_pipeline_stage_zero(model: Any) -> Iterator[None]:
    """Megatron's and the model's pipeline rank read as 0 (how stage 0 builds its ViT)."""
    saved_model_rank = model.pp_rank
    model.pp_rank = 0
    try:
        with pipeline_rank_zero():
            yield
    finally:
        model.pp_rank = saved_model_rank


def vlm_init_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``VLMModel.__init__`` then, under the transposed layout, a ViT replica on every stage
    (see the module docstring)."""
    result = wrapped(*args, **kwargs)
    config = args[0] if args else kwargs["config"]
    if transposed() and getattr(config, "image_encoder", None) is not None:
        build_replica(instance, config)
    return result


def build_replica(model: Any, config: Any) -> None:
    """Give ``model`` (a ``VLMModel`` of any stage) the whole ViT as ``image_encoder``, frozen
    as configured, and stop its forward from running it."""
    from megatron.core import parallel_state
    from megatron.training import get_args

    image = config.image_encoder
    check_supported(get_args(), list(image.vision_encoder.pipeline_num_layers), model.pp_size, model.enable_vp,
                    vision_trainable(image))
    stage = parallel_state.get_pipeline_model_parallel_rank()
    if model.image_encoder is None:  # stages > 0: MindSpeed-MM built none
        with _as_pipeline_stage_zero(model):
            model.image_encoder = model._build_image_encoder_model(image)
    encoder = model.image_encoder
    if not (encoder.pre_process and encoder.post_process):
        raise TransposeUnsupported("vlm: {transpose: true}: the ViT replica was built without its first or "
                                   "last layers (pre_process / post_process)")
    encoder.freeze(*vision_freezing(image))
    if stage > 0:
        for param in encoder.parameters():
            param.shared = True  # Megatron's grad norm / zero count skip it: stage 0's copy counts
    model.add_image_encoder = False  # the LLM chunk takes the ViT's embeddings as its input tensor
    setattr(model, REPLICA_ATTRIBUTE, True)


def replicas(chunks: list) -> list[Any]:
    """The ``VLMModel`` instances with a ViT replica among ``chunks`` (wrapped or not)."""
    found = []
    for chunk in chunks:
        for module in chunk.modules():
            if getattr(module, REPLICA_ATTRIBUTE, False):
                found.append(module)
    return found


def broadcast_replicas(chunks: list) -> int:
    """Stage 0's ViT parameters and buffers into every stage's replica, one flat broadcast
    per dtype over the pipeline group; returns how many tensors were synced."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return 0
    group = parallel_state.get_pipeline_model_parallel_group()
    source = dist.get_process_group_ranks(group)[0]
    nccl = dist.get_backend(group) == "nccl"
    tensors = [t for model in replicas(chunks)
               for t in (*model.image_encoder.parameters(), *model.image_encoder.buffers())]
    by_dtype: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):  # one order on every rank
        group_tensors = by_dtype[dtype]
        flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
        if nccl and flat.device.type == "cpu":
            flat = flat.cuda()
        dist.broadcast(flat, src=source, group=group)
        offset = 0
        with torch.no_grad():
            for t in group_tensors:
                t.copy_(flat[offset: offset + t.numel()].view_as(t).to(t.device))
                offset += t.numel()
    return len(tensors)


def get_model_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``get_model`` then, under the transposed layout, the replicas take stage 0's weights."""
    model = wrapped(*args, **kwargs)
    if transposed():
        chunks = model if isinstance(model, list) else [model]
        if replicas(chunks):
            broadcast_replicas(chunks)
    return model


class VitStage:
    """The ``('vit', 0)`` visit's model: the replica of one chunk, called as the chunk is.

    ``forward_step`` sees ``model.module.module.add_image_encoder`` True and the ViT's
    ``post_process``; ``model(**batch)`` runs the replica on ``pixel_values`` /
    ``image_grid_thw`` and returns the embeddings as ``VLMModel.forward`` hands them to the
    text decoder, ``[-1, 1, H]``.  Not a module: ``parameters()`` are the replica's only."""

    def __init__(self, vlm: Any) -> None:
        self.vlm = vlm
        self.module = SimpleNamespace(module=SimpleNamespace(add_image_encoder=True, image_encoder=vlm.image_encoder))

    def __call__(self, pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                 image_flags: torch.Tensor | None = None, **_batch: Any) -> torch.Tensor:
        if pixel_values is None:
            raise TransposeUnsupported("vlm: {transpose: true}: a microbatch without pixel_values reached the "
                                       "transposed ViT (text-only microbatches are not supported in this layout)")
        with pipeline_rank_zero():
            out = self.vlm.image_encoder(pixel_values, image_grid_thw, None)
        if isinstance(out, tuple):
            raise TransposeUnsupported("vlm: {transpose: true}: this ViT returns several outputs (deepstack "
                                       "embeddings, Qwen3-VL): only a single embedding tensor can be handed on")
        if image_flags is not None:
            out = out[image_flags.squeeze(-1) == 1]
        return out.reshape(-1, 1, out.shape[-1]).clone()

    def set_input_tensor(self, tensors: list) -> None:
        """The ViT starts the model: there is no input tensor to take."""

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return self.vlm.image_encoder.parameters()


def vit_stage(chunk: Any) -> VitStage:
    """The :class:`VitStage` of a model chunk built for the transposed layout."""
    found = replicas([chunk])
    if len(found) != 1:
        raise TransposeUnsupported(
            "vlm: {transpose: true}: the model chunk holds no ViT replica; was it built by MindSpeed-MM's "
            "VLMModel with --use-flowtrain (the schedule feature) on?")
    return VitStage(found[0])
