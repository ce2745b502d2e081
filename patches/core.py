"""Feature ``core``: what makes upstream accept and act on the plugin's flags.

Always enabled when the plugin is active, whatever the feature flags say.
"""

from mindspeed_flow.adapters.megatron import training as megatron_training
from mindspeed_flow.adapters.mindspeed import feature as mindspeed
from mindspeed_flow.patching import Patch
from mindspeed_flow.patching.versions import MEGATRON_LM, MINDSPEED

FEATURE = "core"

PATCHES = [
    Patch(
        feature=FEATURE,
        target="megatron.training.arguments:parse_args",
        wrapper=megatron_training.parse_args_wrapper,
        params="extra_args_provider, ignore_unknown_args",
        checked=(MEGATRON_LM,),
        description="register the --use-flowtrain / --flow-* flags in Megatron's strict parser",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.training.arguments:validate_args",
        wrapper=megatron_training.validate_args_wrapper,
        params="args, defaults",
        checked=(MEGATRON_LM,),
        description="resolve the flags once Megatron has validated its own",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed.features_manager.features_manager:MindSpeedFeaturesManager.set_features_list",
        wrapper=mindspeed.set_features_list_wrapper,
        params="cls, features_list",
        checked=(MINDSPEED,),
        optional=True,
        description="add mindspeed-flow to MindSpeed's feature list (MindSpeed is optional)",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed.patch_utils:MindSpeedPatchesManager.apply_patches",
        wrapper=mindspeed.apply_patches_wrapper,
        params="",
        checked=(MINDSPEED,),
        optional=True,
        description="re-apply our patches that MindSpeed's (or MindSpeed-MM's) patch manager replaced",
    ),
]
