"""Feature ``packing`` (``--flow-packing``): MindSpeed-MM's data path swapped for the
distributed online-packing loader (see :mod:`mindspeed_flow.adapters.mindspeed_mm.data`).
The consumed-samples accounting is declared in :mod:`.packing_accounting`."""

from mindspeed_flow.adapters.mindspeed_mm import data as mindspeed_mm_data
from mindspeed_flow.patching import Patch
from mindspeed_flow.patching.versions import MEGATRON_CORE, MEGATRON_CORE_NEXT, MEGATRON_LM, MINDSPEED_MM, source

FEATURE = "packing"
CHECKED_MM = (source(MINDSPEED_MM),)
CHECKED_MEGATRON = (source(MEGATRON_LM),)

PATCHES = [
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.data:build_mm_dataset",
        wrapper=mindspeed_mm_data.build_dataset,
        params="dataset_param",
        checked=CHECKED_MM,
        description="conversation data: the corpus location for FlowDataLoader, no ahead-of-time preprocessing",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.data:build_mm_dataloader",
        wrapper=mindspeed_mm_data.build_dataloader,
        params="dataset, dataloader_param, process_group, consumed_samples, dataset_param, generator",
        checked=CHECKED_MM,
        description="FlowDataLoader: this DP rank's shard, packed online, one decoder per replica, resumed from its state",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.data.data_utils.utils:build_iterations",
        wrapper=mindspeed_mm_data.build_iterations,
        params="train_dl, val_dl, test_dl, iterator_type",
        checked=CHECKED_MM,
        description="the train loop's iterator: FlowDataLoader epochs, microbatches recorded for the accounting",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.core.pipeline_parallel.schedules:get_forward_backward_func",
        wrapper=mindspeed_mm_data.forward_backward_handoff,
        params="",
        checked=(MEGATRON_CORE, MEGATRON_CORE_NEXT, MEGATRON_LM),
        order=10,  # outside the schedule feature's wrapper, so it wraps whichever schedule that one returns
        description="hand each step's batches to the replica's TP/PP peers before the schedule's first transfer",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.training.checkpointing:save_checkpoint",
        wrapper=mindspeed_mm_data.save_checkpoint,
        params="iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far",
        checked=CHECKED_MEGATRON,
        description="save each decoding rank's loader state beside the checkpoint",
    ),
]
