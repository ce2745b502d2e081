"""Feature ``recipes`` (``--flow-recipes``, implied by any recipe value): per-module
learning rates on Megatron's optimizer param groups and LR scheduler, per-module gradient
clipping after the optimizer's gradient preparation."""

from mindspeed_flow.adapters import megatron_core_recipes as recipes
from mindspeed_flow.patching import Patch

FEATURE = "recipes"
CHECKED = ("megatron-core 0.12.3", "megatron-core 0.16.1")

PATCHES = [
    Patch(
        feature=FEATURE,
        target="megatron.core.optimizer:_get_param_groups",
        wrapper=recipes.param_groups_wrapper,
        params="model_chunks",
        checked=CHECKED,
        description="split Megatron's param groups by module (--flow-module-lr prefixes)",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.core.optimizer_param_scheduler:OptimizerParamScheduler.get_lr",
        wrapper=recipes.get_lr_wrapper,
        params="self, param_group",
        checked=CHECKED,
        description="a module group's LR = schedule x multiplier x own warm-up",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.core.optimizer.optimizer:ChainedOptimizer.prepare_grads",
        wrapper=recipes.prepare_grads_wrapper,
        params="self",
        checked=CHECKED,
        description="clip each module's gradient (--flow-module-grad-clip) before the global norm",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.training.arguments:validate_args",
        wrapper=recipes.validate_args_wrapper,
        params="args, defaults",
        checked=("Megatron-LM core_r0.12.1",),
        description="check and log the recipe values at start-up",
    ),
]
