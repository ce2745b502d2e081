"""Feature ``recipes`` (``--flow-recipes``, implied by any recipe value): per-module
learning rates on Megatron's optimizer param groups and LR scheduler, per-module gradient
clipping after the optimizer's gradient preparation, dynamic per-task loss weights on
MindSpeed-MM's ``VLMModel`` loss (their state saved in and restored from Megatron's
checkpoint)."""

from mindspeed_flow.adapters.megatron import checkpoint as checkpoint_extra
from mindspeed_flow.adapters.megatron import recipes
from mindspeed_flow.adapters.mindspeed_mm import loss as mindspeed_mm_loss
from mindspeed_flow.patching import Patch
from mindspeed_flow.patching.versions import MEGATRON_CORE, MEGATRON_CORE_NEXT, MEGATRON_LM, MINDSPEED_MM, source

FEATURE = "recipes"
CHECKED_CORE = (MEGATRON_CORE, MEGATRON_CORE_NEXT)
CHECKED_MM = (source(MINDSPEED_MM),)
CHECKED_LM = (MEGATRON_LM,)

PATCHES = [
    Patch(
        feature=FEATURE,
        target="megatron.core.optimizer:_get_param_groups",
        wrapper=recipes.param_groups_wrapper,
        params="model_chunks",
        checked=CHECKED_CORE,
        description="split Megatron's param groups by module (--flow-module-lr prefixes)",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.core.optimizer_param_scheduler:OptimizerParamScheduler.get_lr",
        wrapper=recipes.get_lr_wrapper,
        params="self, param_group",
        checked=CHECKED_CORE,
        description="a module group's LR = schedule x multiplier x own warm-up",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.core.optimizer.optimizer:ChainedOptimizer.prepare_grads",
        wrapper=recipes.prepare_grads_wrapper,
        params="self",
        checked=CHECKED_CORE,
        description="clip each module's gradient (--flow-module-grad-clip) before the global norm",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.training.arguments:validate_args",
        wrapper=recipes.validate_args_wrapper,
        params="args, defaults",
        checked=CHECKED_LM,
        description="check and log the recipe values at start-up",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.models.vlm_model:VLMModel.forward",
        wrapper=mindspeed_mm_loss.vlm_forward,
        params="self, input_ids, pixel_values, image_grid_thw, attention_mask, labels, inference_params, "
               "decoder_input, position_ids, packed_seq_params",
        checked=CHECKED_MM,
        description="keep the batch's sample_ids / packing for the loss (--flow-loss-weighting)",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.models.vlm_model:VLMModel.compute_language_model_loss",
        wrapper=mindspeed_mm_loss.language_model_loss,
        params="self, logits, labels",
        checked=CHECKED_MM,
        description="weight each token's loss by its sample's task weight (TP = 1)",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.models.vlm_model:VLMModel.compute_loss_with_tensor_parallel",
        wrapper=mindspeed_mm_loss.tensor_parallel_loss,
        params="self, logits, labels",
        checked=CHECKED_MM,
        description="weight each token's loss by its sample's task weight (TP > 1)",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.training.checkpointing:generate_state_dict",
        wrapper=checkpoint_extra.generate_state_dict_wrapper,
        params="args, model, optimizer, opt_param_scheduler, rng_state",
        checked=CHECKED_LM,
        description="save the loss-weighting state with the checkpoint (--flow-loss-weighting)",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.training.checkpointing:_load_base_checkpoint",
        wrapper=checkpoint_extra.load_base_checkpoint_wrapper,
        params="load_dir, args, rank0, sharded_state_dict, checkpointing_context",
        checked=CHECKED_LM,
        description="restore the loss-weighting state from the checkpoint (--flow-loss-weighting)",
    ),
]
