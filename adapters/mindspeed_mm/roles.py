"""MindSpeed-MM's model built by role under FlowTrain's decoupled layout.

``pretrain_vlm.model_provider`` deep-copies ``args.mm.model`` and hands it to ``VLMModel``;
the wrapper of ``VLMModel.__init__`` (:func:`vlm_init_wrapper`) edits that copy for this
rank's role before the model is built:

- an encoder rank keeps ``image_encoder`` (ViT + projector) only: ``text_decoder`` (and
  ``audio_encoder``) go, and the ViT is built whole (the encoder's pipeline has one stage, so
  ``VLMModel`` builds every layer: ``vision_encoder.pipeline_num_layers`` becomes its total);
  its forward returns the embeddings ``[-1, 1, H]``, which the runtime puts into the pool;
- a backbone rank keeps its ``text_decoder`` stage only (the embedding on the first stage,
  the output layer on the last, as Megatron's pipeline builds them); ``VLMModel.forward``
  then reads the ViT embeddings from ``self.input_tensor``, which the runtime sets from the
  pool (``set_input_tensor``).

Parameter names stay those of the co-located model (``image_encoder.*``, ``text_decoder.*``
with Megatron's per-stage layer numbering), so Megatron's DDP, optimizer and checkpoints
treat each role's parameters as their own shard of one model.
"""

from __future__ import annotations

from typing import Any, Callable

from mindspeed_flow.schedule.regions import ENCODER_REGION


def role_region() -> str | None:
    """This rank's region under the decoupled layout (``None``: no decoupled layout)."""
    from mindspeed_flow.adapters.megatron.roles import ROLES

    layout = ROLES.layout
    if layout is None:
        return None
    import torch.distributed as dist

    return layout.role(dist.get_rank()).region


def configure_for_role(config: Any, region: str) -> Any:
    """``config`` (a copy of ``args.mm.model``) edited in place to build ``region``'s part."""
    if region == ENCODER_REGION:
        if getattr(config, "image_encoder", None) is None:
            raise ValueError("the decoupled layout's encoder ranks build the image encoder, but the model has none")
        config.text_decoder = None
        if hasattr(config, "audio_encoder"):
            config.audio_encoder = None
        vision = config.image_encoder.vision_encoder
        layers = getattr(vision, "pipeline_num_layers", None)
        if layers is not None:
            vision.pipeline_num_layers = [sum(layers)]
    else:
        if getattr(config, "text_decoder", None) is None:
            raise ValueError("the decoupled layout's backbone ranks build the text decoder, but the model has none")
        config.image_encoder = None
        if getattr(config, "audio_encoder", None) is not None:
            raise ValueError("the decoupled layout carries image embeddings only: an audio encoder is not supported")
    return config


def vlm_init_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``VLMModel(config)`` building this rank's role only (see the module docstring).  On a
    slice's encoder replicas after the first, the ViT's parameters are marked ``shared`` (as
    Megatron marks a tied embedding's second copy): their gradients are the first replica's
    after DDP's all-reduce, and the gradient norm and zero count, taken over the slice, must
    count them once."""
    region = role_region()
    if region is None:
        return wrapped(*args, **kwargs)
    config = args[0] if args else kwargs["config"]
    configure_for_role(config, region)
    result = wrapped(*args, **kwargs)
    from mindspeed_flow.adapters.megatron.roles import encoder_replica

    if region == ENCODER_REGION and encoder_replica() > 0:
        for param in instance.parameters():
            param.shared = True
    return result


TRAINING_LOG_PARAMS = ("loss_dict", "total_loss_dict", "learning_rate", "decoupled_learning_rate", "iteration")


def training_log_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``mindspeed_mm.training.training_log`` on an encoder rank whose model trains nothing (a
    frozen ViT + projector): Megatron builds a stub optimizer there (no parameter groups, as
    it does for frozen sub-models), so MindSpeed-MM's loop finds no learning rate and its log
    refuses ``None`` (``AssertionError``), and, under ``--decoupled-lr``, no decoupled one
    either (the encoder rank is its role's first and last stage, where the log wants one).
    That rank's log line is never shown (the log is printed by the last rank, a backbone
    rank; the tensorboard writer is the last rank's), so it gets 0.0 for each; every other
    rank's log is upstream's.  With a learning rate of 0.0 the log's one-time memory report
    (``learning_rate > 0.``) is not printed by that rank: the backbone ranks print theirs."""
    from megatron.training import get_args

    from .model import _argument, _with_argument

    if role_region() == ENCODER_REGION:
        wanted = ["learning_rate"] + (["decoupled_learning_rate"] if get_args().decoupled_lr is not None else [])
        for name in wanted:
            if _argument(args, kwargs, TRAINING_LOG_PARAMS, name) is None:
                args, kwargs = _with_argument(args, kwargs, TRAINING_LOG_PARAMS, name, 0.0)
    return wrapped(*args, **kwargs)
