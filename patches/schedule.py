"""Feature ``schedule`` (``--flow-schedule``, layout from ``--flow-schedule-config``): Megatron's
``get_forward_backward_func()`` returns the mindspeed-flow runtime running a composed plan
(:mod:`mindspeed_flow.adapters.megatron.schedule`).  Without a layout it runs Megatron's
own 1F1B / interleaved order, so turning it on changes no number; features that swap the
same schedule (DualPipeV, RiPipe, ``--hetero-parallel``) are refused when arguments are
validated; ``--variable-seq-lengths`` composes (its p2p patch is never reached: every transfer
of our runtime carries its own shape).
"""

from mindspeed_flow.adapters.megatron import schedule as megatron_core_schedule
from mindspeed_flow.adapters.mindspeed_mm import transpose as mindspeed_mm_transpose
from mindspeed_flow.patching import Patch
from mindspeed_flow.patching.versions import MEGATRON_CORE, MEGATRON_CORE_NEXT, MEGATRON_LM, MINDSPEED_MM, source

FEATURE = "schedule"

PATCHES = [
    Patch(
        feature=FEATURE,
        target="megatron.core.pipeline_parallel.schedules:get_forward_backward_func",
        wrapper=megatron_core_schedule.get_forward_backward_func_wrapper,
        params="",
        checked=(MEGATRON_CORE, MEGATRON_CORE_NEXT, MEGATRON_LM),
        description="run the composed schedule: our runtime behind Megatron's forward_backward_func",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.training.arguments:validate_args",
        wrapper=megatron_core_schedule.validate_args_wrapper,
        params="args, defaults",
        checked=(MEGATRON_LM,),
        order=5,
        description="refuse features that swap the same schedule; load --flow-schedule-config at start-up",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.models.vlm_model:VLMModel.__init__",
        wrapper=mindspeed_mm_transpose.vlm_init_wrapper,
        params="self, config",
        checked=(source(MINDSPEED_MM),),
        description="vlm: {transpose: true}: a whole ViT replica on every pipeline rank; the LLM chunk takes its embeddings",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.training.training:get_model",
        wrapper=mindspeed_mm_transpose.get_model_wrapper,
        params="model_provider_func, model_type, wrap_with_ddp",
        checked=(MEGATRON_LM,),
        description="vlm: {transpose: true}: the ViT replicas take stage 0's weights once, before the optimizer",
    ),
]
