"""One upstream job in one process: MindSpeed's adaptor, Megatron's initialisation and
MindSpeed-MM's ``VLMModel``, one forward/backward through the ``forward_backward_func``
Megatron's getter returns (its own schedule; the plugin's runtime under ``--use-flowtrain``).

Run by :mod:`harness` (never imported by the test process): as ``python driver.py ARGS`` for
upstream as it is, or ``python -m mindspeed_flow.launch driver.py ARGS --use-flowtrain``
with the plugin.  ``ARGS`` is the full Megatron / MindSpeed / MindSpeed-MM command line,
read by MindSpeed at import exactly as in ``pretrain_vlm.py``; what this job does besides
(which batches, where to write) comes in the JSON file named by ``MINDSPEED_FLOW_HARNESS_JOB``.

The model is built the way ``pretrain_vlm.model_provider`` builds it (deep copy of
``args.mm.model``, ``get_model_config`` on each part, ``VLMModel``), without importing
``pretrain_vlm`` itself, whose data pipeline needs datasets, pandas, av and torchvision.
"""

from __future__ import annotations

import json
import os
import re
import sys
from contextlib import contextmanager
from copy import deepcopy
from pathlib import Path

import mindspeed.megatron_adaptor  # noqa: F401  (first: MindSpeed patches Megatron at import)
import torch

JOB = json.loads(Path(os.environ["MINDSPEED_FLOW_HARNESS_JOB"]).read_text())
IMAGE_TOKEN = 151655
VISION_START = 151652
VISION_END = 151653
PATCH_VALUES = 3 * 2 * 14 * 14  # channels * temporal_patch * patch * patch


def model_provider(pre_process: bool = True, post_process: bool = True):
    """``pretrain_vlm.model_provider`` for an image + text model, freezing as the JSON says."""
    from megatron.training import get_args
    from mindspeed_mm.models.vlm_model import VLMModel
    from mindspeed_mm.utils.transformer_model_config import get_model_config

    config = deepcopy(get_args().mm.model)
    config.pre_process, config.post_process = pre_process, post_process
    image = config.image_encoder
    image.vision_projector.context_parallel_size = 1
    image.vision_encoder.expert_model_parallel_size = 1
    image.vision_projector.expert_model_parallel_size = 1
    image.vision_encoder = get_model_config(image.vision_encoder)
    image.vision_projector = get_model_config(image.vision_projector)
    config.text_decoder = get_model_config(config.text_decoder)
    model = VLMModel(config)
    model.freeze(freeze_image_encoder=getattr(image.vision_encoder, "freeze", True),
                 freeze_image_projection=getattr(image.vision_projector, "freeze", False),
                 freeze_audio_encoder=False)
    return model


def sample_tensors(spec: dict) -> dict:
    """One Qwen2.5-VL sample as MindSpeed-MM's collator emits it, from a seeded spec.

    ``[start] image tokens [end] text``; labels are -100 up to the image end and the
    token ids after it (the model shifts them itself).
    """
    gen = torch.Generator().manual_seed(spec["seed"])
    t, h, w = spec["grid"]
    image_tokens = t * h * w // 4  # spatial_merge_size 2
    text = torch.randint(0, 150000, (spec["text"],), generator=gen)
    ids = torch.cat([torch.tensor([VISION_START]), torch.full((image_tokens,), IMAGE_TOKEN),
                     torch.tensor([VISION_END]), text])
    labels = ids.clone()
    labels[: image_tokens + 2] = -100
    return {
        "input_ids": ids.unsqueeze(0),
        "labels": labels.unsqueeze(0),
        "attention_mask": torch.ones(1, ids.numel(), dtype=torch.long),
        "pixel_values": torch.randn(t * h * w, PATCH_VALUES, generator=gen),
        "image_grid_thw": torch.tensor([[t, h, w]]),
    }


def packed_batch(samples: list[dict]) -> dict:
    """Samples end to end in one row, with ``cu_seqlens`` and per-sample M-RoPE positions
    computed by upstream's own ``qwen2_5_vl_get_rope_index`` for each sample alone."""
    from megatron.training import get_args
    from mindspeed_mm.models.vision.vlm_attentionmask_for_llm import qwen2_5_vl_get_rope_index

    config = get_args().mm.model
    positions = [qwen2_5_vl_get_rope_index(config, s["input_ids"], s["image_grid_thw"],
                                           attention_mask=s["attention_mask"])[0] for s in samples]
    lengths = [s["input_ids"].shape[1] for s in samples]
    return {
        "input_ids": torch.cat([s["input_ids"] for s in samples], dim=1),
        "labels": torch.cat([s["labels"] for s in samples], dim=1),
        "attention_mask": torch.cat([s["attention_mask"] for s in samples], dim=1),
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]),
        "position_ids": torch.cat(positions, dim=-1),
        "cu_seqlens": torch.tensor([0] + lengths).cumsum(0).to(torch.int32),
    }


def microbatches() -> list[dict]:
    samples = [sample_tensors(spec) for spec in JOB["samples"]]
    return [packed_batch(samples)] if JOB["layout"] == "packed" else samples


def forward_step(data_iterator, model):
    """``pretrain_vlm.forward_step`` / ``loss_func`` under ``--calculate-per-token-loss``."""
    from megatron.training import get_args
    from mindspeed_mm.utils.utils import compute_token_level_loss

    batch = {k: (v.to(get_args().params_dtype) if torch.is_floating_point(v) else v)
             for k, v in next(data_iterator).items()}

    def loss_func(output):
        loss, tokens, reporting = compute_token_level_loss(output["loss_dict"])
        return loss[0].clone(), tokens, {"loss": (reporting[0], reporting[1])}

    return model(**batch), loss_func


def initialise() -> None:
    import megatron.training.initialize as megatron_init
    from megatron.training import get_args
    from mindspeed_mm.arguments import extra_args_provider_decorator
    from mindspeed_mm.configs.config import merge_mm_args, mm_extra_args_provider

    # As mindspeed_mm.training.pretrain initialises, minus _compile_dependencies: it runs
    # `make` on Megatron's dataset helpers inside the upstream tree, and no dataset is used.
    megatron_init._compile_dependencies = lambda: None
    megatron_init.initialize_megatron(extra_args_provider=extra_args_provider_decorator(mm_extra_args_provider),
                                      args_defaults={"dataloader_type": "external"})
    merge_mm_args(get_args())


@contextmanager
def counted_p2p_calls():
    """Count calls of Megatron's ``p2p_communication._communicate`` (as MindSpeed's
    ``--variable-seq-lengths`` patch left it) during the step: Megatron's schedules send
    through it, the plugin's runtime must not."""
    from megatron.core.pipeline_parallel import p2p_communication

    inner = p2p_communication._communicate
    calls = [0]

    def counting(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    p2p_communication._communicate = counting
    try:
        yield calls
    finally:
        p2p_communication._communicate = inner


def train_step(model) -> dict:
    from megatron.core import mpu
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config
    from megatron.training import get_args

    args = get_args()
    config = get_model_config(model[0])
    config.finalize_model_grads_func = finalize_model_grads
    batches = microbatches()
    for chunk in model:
        chunk.zero_grad_buffer()
    forward_backward = get_forward_backward_func()
    with counted_p2p_calls() as p2p_calls:
        losses = forward_backward(
            forward_step_func=forward_step, data_iterator=iter(batches), model=model,
            num_microbatches=len(batches), seq_length=args.seq_length, micro_batch_size=1,
            decoder_seq_length=args.seq_length, forward_only=False)
    result: dict = {"microbatches": len(batches), "p2p_communicate_calls": p2p_calls[0], "vit_replica": VIT_REPLICA,
                    "shared_params": sorted(global_name(n) for c in model for n, p in c.named_parameters()
                                            if getattr(p, "shared", False)),
                    "forward_backward_func": f"{forward_backward.__module__}:{forward_backward.__qualname__}"}
    if mpu.is_pipeline_last_stage():
        total = sum(float(l["loss"][0]) for l in losses)
        tokens = sum(float(l["loss"][1]) for l in losses)
        result.update(loss_sum=total, tokens=tokens, loss=total / tokens)
    return result


# Layer lists whose names restart at 0 on every pipeline stage, and the JSON part that says
# how many layers each stage holds.
STAGED_LAYERS = {"text_decoder.decoder.layers.": ("text_decoder",),
                 "image_encoder.encoder.blocks.layers.": ("image_encoder", "vision_encoder")}


# Whether this stage's ViT is a replica of stage 0's (the plugin's transposed layout, ``vlm:
# {transpose: true}``): its layers are then named as on stage 0.  Set once the model is built.
VIT_REPLICA = False


def _layers_before_this_stage(path: tuple[str, ...]) -> int:
    from megatron.core import mpu
    from megatron.training import get_args

    if VIT_REPLICA and path[0] == "image_encoder":
        return 0
    part = get_args().mm.model
    for key in path:
        part = getattr(part, key)
    return sum(part.pipeline_num_layers[: mpu.get_pipeline_model_parallel_rank()])


def global_name(name: str) -> str:
    """A parameter's name as in a single-stage model: stage-local layer numbers made global,
    so that runs with different pipeline sizes compare name for name."""
    for prefix, path in STAGED_LAYERS.items():
        match = re.search(re.escape(prefix) + r"(\d+)\.", name)
        if match:
            number = int(match.group(1)) + _layers_before_this_stage(path)
            return name[: match.start(1)] + str(number) + name[match.end(1):]
    return name


def gradients(model) -> dict[str, torch.Tensor]:
    """fp32 main gradients (what the optimizer would read) by global parameter name."""
    grads = {}
    for chunk in model:
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            if grad is not None:
                grads[global_name(name)] = grad.detach().float().clone()
    return grads


def load_initial_weights(model) -> None:
    """This stage's share of a saved state (saved by a run of any pipeline size)."""
    saved: dict = {}
    rank = 0
    while Path(JOB["load"].format(rank=rank)).is_file():  # every stage of the saving run
        for state in torch.load(JOB["load"].format(rank=rank), weights_only=False):
            saved.update(state)
        rank += 1
    for chunk in unwrapped(model):
        local = chunk.state_dict()
        chunk.load_state_dict({key: saved[global_name(key)] for key in local})


def save_initial_weights(model) -> None:
    torch.save([{global_name(k): v for k, v in chunk.state_dict().items()} for chunk in unwrapped(model)],
               rank_path("save"))


def _layer_name(obj) -> str:
    """``file:qualname`` of one layer from its code object (``functools.wraps`` copies the
    wrapped function's names, the code object keeps its own); a wrapt wrapper is named by
    its wrapper function, prefixed ``wrapt``."""
    wrapper = getattr(obj, "_self_wrapper", None)
    named = wrapper or obj
    code = getattr(named, "__code__", None)
    if code is None:
        return f"{type(named).__module__}:{type(named).__qualname__}"
    return f"{'wrapt ' if wrapper else ''}{code.co_filename}:{code.co_qualname}"


def attention_chain() -> dict:
    """Every layer of ``DotProductAttention.forward``'s ``__wrapped__`` chain, outermost
    first, and where the innermost function is defined."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    layers = []
    obj = vars(DotProductAttention)["forward"]
    while obj is not None and len(layers) < 32:
        layers.append(_layer_name(obj))
        inner = getattr(obj, "__wrapped__", None)
        if inner is None:
            break
        obj = inner
    code = getattr(obj, "__code__", None)
    return {"layers": layers, "innermost_file": code.co_filename if code else None}


def unwrapped(model) -> list:
    from megatron.training.utils import unwrap_model

    return unwrap_model(model)


def _first_tensor(output) -> torch.Tensor:
    """A module's output, or the first element of a tuple output (a layer's hidden states)."""
    tensor = output[0] if isinstance(output, (tuple, list)) else output
    return tensor.detach().float().clone()


def capture_outputs(model) -> dict[str, list[torch.Tensor]]:
    """Forward outputs of the submodules named in the job's ``capture`` list, one entry per
    call (per microbatch), to tell where two runs part ways."""
    captured: dict[str, list[torch.Tensor]] = {}
    for chunk in unwrapped(model):
        modules = dict(chunk.named_modules())
        for name in JOB.get("capture", []):
            if name in modules:
                captured[name] = []
                modules[name].register_forward_hook(
                    lambda module, args, output, key=name: captured[key].append(_first_tensor(output)))
    return captured


def rank_path(key: str) -> str:
    """The job's path for ``key`` with this process's rank filled in."""
    return JOB[key].format(rank=torch.distributed.get_rank())


def main() -> None:
    from megatron.core.enums import ModelType
    from megatron.training.training import get_model

    global VIT_REPLICA
    initialise()
    model = get_model(model_provider, ModelType.encoder_or_decoder)
    VIT_REPLICA = any(getattr(m, "_flow_vit_replica", False) for chunk in model for m in chunk.modules())
    if JOB.get("load"):  # the same initial weights in every run, whatever RNG the patches use
        load_initial_weights(model)
    if JOB.get("save"):
        save_initial_weights(model)
    captured = capture_outputs(model)
    result = train_step(model)
    torch.save(captured, rank_path("captures"))
    torch.save(gradients(model), rank_path("grads"))
    result["attention_chain"] = attention_chain()
    import megatron.core  # which copy ran: the harness must load the one inside MindSpeed-MM
    result["megatron_package"] = sorted({str(Path(p).resolve()) for p in megatron.__path__}
                                        | {str(Path(megatron.core.__file__).resolve().parents[1])})
    from mindspeed_flow.activation import current_registry

    registry = current_registry()
    result["plugin_active"] = registry is not None
    if registry is not None:
        result["patches"] = [[r.feature, r.target, r.status] for r in registry.report()]
        registry.remove()
        result["attention_chain_after_remove"] = attention_chain()
    from torch_npu import _record
    result["standin"] = _record.summary()
    Path(rank_path("result")).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    sys.exit(0)
