"""FlowTrain's decoupled layout and its pool in Megatron's / MindSpeed-MM's real job (feature
``pool``: ``--flow-pool``, ``--flow-pool-backend`` or ``--use-flowtrain``).  The layout comes
from ``--flow-schedule-config`` (its ``decoupled:`` form) or a decoupled ``--flow-allocator-plan``
(:func:`mindspeed_flow.adapters.megatron.decoupled_layout.decoupled_layout`, read by the
``validate_args`` wrapper, which configures :mod:`mindspeed_flow.adapters.megatron.roles`):

- ``validate_args`` sees this rank's role's world size, TP and PP;
- ``initialize_model_parallel`` builds Megatron's groups per role over that role's ranks,
  then the runtime's cross-role groups;
- ``VLMModel.__init__`` builds this rank's part (ViT + projector, or its LLM stage);
- MindSpeed-MM's ``training_log`` runs on an encoder rank that trains nothing (a frozen ViT:
  Megatron's stub optimizer has no learning rate to log);
- the optimizer's gradient statistics (``--clip-grad``'s norm) are reduced over the slice,
  both roles together;
- ``save_checkpoint`` also writes each file's optimizer parameter names and the layout's
  form; ``load_checkpoint`` assembles a checkpoint of the other form (decoupled /
  co-located) for this rank by name (:mod:`mindspeed_flow.adapters.megatron.role_checkpoint`);
- ``get_forward_backward_func`` returns the decoupled step (the slice's plan through the
  runtime's executor and the pool, or with the layout's ``flow: true`` FlowTrain's flow:
  per-sample pool entries, :mod:`mindspeed_flow.adapters.megatron.decoupled_flow`), outside
  the schedule feature's own wrapper.

Without a decoupled layout every wrapper calls Megatron's / MindSpeed-MM's own function, and
no pool is opened (the job's log says so).
"""

from mindspeed_flow.adapters.megatron import decoupled_step, role_checkpoint, roles
from mindspeed_flow.adapters.megatron.decoupled_layout import DECOUPLED_FEATURE as FEATURE
from mindspeed_flow.adapters.mindspeed_mm import roles as mm_roles
from mindspeed_flow.patching import Patch
from mindspeed_flow.patching.versions import MEGATRON_LM, MINDSPEED_MM


def get_forward_backward_func_wrapper(wrapped, instance, args, kwargs):
    """The decoupled step when a decoupled layout is configured; the wrapped getter otherwise."""
    if roles.ROLES.layout is not None:
        return decoupled_step.decoupled_forward_backward
    return wrapped(*args, **kwargs)


PATCHES = [
    Patch(
        feature=FEATURE,
        target="megatron.training.arguments:validate_args",
        wrapper=roles.validate_args_wrapper,
        params="args, defaults",
        checked=(MEGATRON_LM,),
        # inside the allocator's (10: a decoupled plan's sizes are written first), outside the
        # schedule feature's (5: it validates the role's arguments)
        order=8,
        description="decoupled layout: Megatron validates each rank's role's world size, TP and PP",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.core.parallel_state:initialize_model_parallel",
        wrapper=roles.initialize_model_parallel_wrapper,
        checked=(MEGATRON_LM,),
        order=20,
        description="decoupled layout: Megatron's groups per role over its own ranks; the runtime's groups beside",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.models.vlm_model:VLMModel.__init__",
        wrapper=mm_roles.vlm_init_wrapper,
        params="self, config",
        checked=(MINDSPEED_MM,),
        order=20,
        description="decoupled layout: encoder ranks build ViT + projector, backbone ranks their LLM stage",
    ),
    Patch(
        feature=FEATURE,
        target="mindspeed_mm.training:training_log",
        wrapper=mm_roles.training_log_wrapper,
        params="loss_dict, total_loss_dict, learning_rate, decoupled_learning_rate, iteration",
        checked=(MINDSPEED_MM,),
        order=20,
        description="decoupled layout: a frozen ViT's encoder rank (a stub optimizer, no learning rate) logs",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.core.optimizer.optimizer:MegatronOptimizer.get_grad_stats_parallel_group",
        wrapper=roles.grad_stats_group_wrapper,
        params="self",
        checked=(MEGATRON_LM,),
        order=20,
        description="decoupled layout: the gradient norm (--clip-grad) and found-inf over both roles of the slice",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.training.checkpointing:save_checkpoint",
        wrapper=role_checkpoint.save_checkpoint_wrapper,
        params="iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far",
        checked=(MEGATRON_LM,),
        order=20,
        description="checkpoints: each file's optimizer parameter names and the layout's form beside it",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.training.checkpointing:load_checkpoint",
        wrapper=role_checkpoint.load_checkpoint_wrapper,
        params="ddp_model, optimizer, opt_param_scheduler",
        checked=(MEGATRON_LM,),
        order=20,
        description="checkpoints: the model and optimizer being loaded, for the cross-layout assembly",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.training.checkpointing:_load_base_checkpoint",
        wrapper=role_checkpoint.load_base_checkpoint_wrapper,
        params="load_dir, args",
        checked=(MEGATRON_LM,),
        order=20,
        description="checkpoints: a decoupled checkpoint assembled for a co-located rank, and back, by name",
    ),
    Patch(
        feature=FEATURE,
        target="megatron.core.pipeline_parallel.schedules:get_forward_backward_func",
        wrapper=get_forward_backward_func_wrapper,
        params="",
        checked=(MEGATRON_LM,),
        # inside the packing loader's hand-off (10: each step's batches reach the role's
        # pipeline peers first), outside the schedule feature's (0), which it replaces
        order=5,
        description="decoupled layout: the slice's plan through the runtime's executor and the pool",
    ),
]
