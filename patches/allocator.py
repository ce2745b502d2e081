"""Feature ``allocator`` (``--flow-allocator``, plan from ``--flow-allocator-plan``): apply
a plan of ``mindspeed-flow plan`` at initialisation.

Megatron: the backbone's TP/PP sizes, micro and global batch (and an uneven first/last
stage) are written into ``args`` before ``validate_args`` derives the rest.  MindSpeed-MM
(whose ``initialize_megatron`` goes through the same ``validate_args``): after
``merge_mm_args`` the model config gets the per-module ``pipeline_num_layers`` lists and
the vision encoder's own TP size (used by ``--hetero-parallel``).
"""

from mindspeed_flow.adapters.megatron import allocator_plan
from mindspeed_flow.patching import Patch
from mindspeed_flow.patching.versions import MEGATRON_LM, MINDSPEED_MM, source

FEATURE = "allocator"

PATCHES = [
    Patch(
        feature=FEATURE,
        target="megatron.training.arguments:validate_args",
        wrapper=allocator_plan.validate_args_wrapper,
        params="args, defaults",
        checked=(MEGATRON_LM,),
        order=10,  # outside core's wrapper: the sizes are in place before anything validates
        description="write the plan's parallel sizes and batch into args before Megatron validates them",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.configs.config:merge_mm_args",
        wrapper=allocator_plan.merge_mm_args_wrapper,
        params="args",
        checked=(source(MINDSPEED_MM),),
        optional=True,
        description="set vision_encoder / text_decoder pipeline_num_layers and the encoder's TP from the plan",
    ),
]
