"""Feature ``packing`` (``--flow-packing``): MindSpeed-MM's data path swapped for the
distributed online-packing loader (see :mod:`mindspeed_flow.adapters.mindspeed_mm.data`).
The consumed-samples accounting is declared in :mod:`.packing_accounting`."""

from mindspeed_flow.adapters.mindspeed_mm import data as mindspeed_mm_data
from mindspeed_flow.patching import Patch

FEATURE = "packing"
MINDSPEED_MM = ("MindSpeed-MM 57069cd (source)",)
MEGATRON = ("Megatron-LM core_v0.12.1 (source)",)

PATCHES = [
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.data:build_mm_dataset",
        wrapper=mindspeed_mm_data.build_dataset,
        params="dataset_param",
        checked=MINDSPEED_MM,
        description="conversation data: the corpus location for FlowDataLoader, no ahead-of-time preprocessing",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.data:build_mm_dataloader",
        wrapper=mindspeed_mm_data.build_dataloader,
        params="dataset, dataloader_param, process_group, consumed_samples, dataset_param, generator",
        checked=MINDSPEED_MM,
        description="FlowDataLoader: this DP rank's shard, packed online, one decoder per replica, resumed from its state",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.data.data_utils.utils:build_iterations",
        wrapper=mindspeed_mm_data.build_iterations,
        params="train_dl, val_dl, test_dl, iterator_type",
        checked=MINDSPEED_MM,
        description="the train loop's iterator: FlowDataLoader epochs, microbatches recorded for the accounting",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.core.pipeline_parallel.schedules:get_forward_backward_func",
        wrapper=mindspeed_mm_data.forward_backward_handoff,
        params="",
        checked=("megatron-core 0.12.3", "megatron-core 0.16.1", "Megatron-LM core_r0.12.1"),
        order=10,  # outside the schedule feature's wrapper, so it wraps whichever schedule that one returns
        description="hand each step's batches to the replica's TP/PP peers before the schedule's first transfer",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.training.checkpointing:save_checkpoint",
        wrapper=mindspeed_mm_data.save_checkpoint,
        params="iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far",
        checked=MEGATRON,
        description="save each decoding rank's loader state beside the checkpoint",
    ),
]
