"""Megatron's ``forward_backward_func`` for FlowTrain's decoupled layout: every rank runs
its slice's program of the ``<Decoupled, 1F1B>`` plan through the runtime's
:class:`~mindspeed_flow.runtime.Executor` with the slice's pool.

Microbatches.  Megatron gives the backbone ranks ``N = global / (micro_batch * backbone_dp)``
microbatches a step and the encoder ranks ``N / encoder_dp`` (their data-parallel size is
``encoder_dp * backbone_dp``); the plan is the slice's, over its ``N``.  An encoder rank is
fed its slice's data iterator (the one its slice's first backbone stage reads) and its
program forwards microbatches ``m % encoder_dp == e`` only: the runtime's feed pulls the
items before them and drops them, and the rest of the step's ``N`` are taken after the step
(:class:`CountingIterator`), so every replica starts the next step at its first microbatch.

Gradients.  The plan's ``REDUCE`` sums the weight gradients (DDP's ``main_grad``) of a
slice's encoder replicas after their last backward, so every replica holds its slice's
encoder gradients, as the slice's backbone stages hold theirs.  Then Megatron's own
machinery: DDP over each role's data-parallel group (:mod:`.roles`: never the two roles
together), then ``finalize_model_grads``.  The encoder's group has ``encoder_dp`` equal
copies of each slice's gradients, so both of Megatron's reductions come out as the
backbone's: averaged loss divides the sum by the group size ``encoder_dp * backbone_dp``;
per-token loss (``--calculate-per-token-loss``) divides it by the token count all-reduced
over the same group, where every encoder rank passes its slice's count (known on the
slice's last backbone stage only, so broadcast over the slice first).  (DDP's overlapped
gradient all-reduce would race with that ``REDUCE``: ``--overlap-grad-reduce`` is refused,
:func:`.roles.check_supported`.)

With ``flow: true`` in the layout the step is FlowTrain's flow instead of the plan: the encoder
rank encodes the step's samples in batches of its own and puts one pool entry per sample, the
backbone runs its pipeline's 1F1B and takes each microbatch's samples by key
(:mod:`.decoupled_flow`; a frozen ViT's encoder rank runs ahead into the next training
step after its own); the pool, the loss dicts, the token count and the gradient
finalisation around it are the same.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from mindspeed_flow.schedule.regions import ENCODER_REGION

log = logging.getLogger(__name__)

DEFAULT_POOL_BYTES = 256 << 20


@dataclass
class StepState:
    """What the first step built: the executor, its pool, the plans by microbatch count."""

    executor: Any = None
    pool: Any = None
    pool_name: str | None = None
    backend: str | None = None
    plans: dict = field(default_factory=dict)


STATE = StepState()


def pool_backend() -> str:
    """``--flow-pool-backend`` as the config tree holds it; ``shm`` (one node) without it."""
    from mindspeed_flow.activation import current_config

    config = current_config()
    backend = getattr(config, "pool_backend", None) if config is not None else None
    return backend or "shm"


def trainable_encoder() -> bool:
    """Whether the ViT region has a backward (some part of ViT + projector trains): read from
    MindSpeed-MM's model config, the same on every rank (the plan must be)."""
    from megatron.training import get_args

    image = getattr(getattr(getattr(get_args(), "mm", None), "model", None), "image_encoder", None)
    if image is None:
        return True
    return not (getattr(image.vision_encoder, "freeze", True) and getattr(image.vision_projector, "freeze", False))


def _executor(layout: Any, groups: dict) -> Any:
    import torch.distributed as dist

    from mindspeed_flow.adapters.megatron.schedule import SETTINGS
    from mindspeed_flow.pool.job import job_pool_name, open_slice_pool, remove_at_exit
    from mindspeed_flow.runtime import Executor

    if STATE.executor is None:
        rank = dist.get_rank()
        STATE.backend = pool_backend()
        STATE.pool_name = job_pool_name()
        # The flow's consumers wait on a producer's announced keys and call it dead when its
        # heartbeat (a thread) stalls for liveness_s: a quarter of the runtime's timeout, not the
        # pool's 3 s default, which a busy encoder rank on a loaded CPU overruns.
        liveness = {"liveness_s": SETTINGS.options.wait.timeout_s / 4} if layout.flow else {}
        STATE.pool = open_slice_pool(STATE.backend, layout, groups, STATE.pool_name, DEFAULT_POOL_BYTES, **liveness)
        if rank == 0:
            log.info("mindspeed-flow pool: %s pools named %s-b<slice> open", STATE.backend, STATE.pool_name)
        if rank == 0 or STATE.pool is not None:  # any survivor of a dying rank removes the pools
            remove_at_exit(STATE.backend, STATE.pool_name)
        ranks = layout.executor_ranks(rank)
        STATE.executor = Executor(ranks.index(rank), ranks, group=groups["replica"], options=SETTINGS.options,
                                  pool=STATE.pool)
        dist.barrier()  # every participant's pool is open before the first put
    return STATE.executor


def in_params_dtype(forward_step_func: Callable, dtype: Any) -> Callable:
    """An encoder rank's ``forward_step_func`` whose output (the embeddings the pool carries)
    is in the parameters' dtype.  Megatron's ``Float16Module`` hands a last pipeline stage's
    output back in fp32, for the loss; an encoder rank is its role's last stage, but its output
    is the LLM's input, which the co-located model takes in the parameters' dtype (bf16 -> fp32
    -> bf16 is exact, and the pool carries half the bytes)."""

    def forward_step(data_iterator: Any, model: Any) -> Any:
        output, loss_func = forward_step_func(data_iterator, model)
        if hasattr(output, "dtype") and output.is_floating_point() and output.dtype != dtype:
            output = output.to(dtype)
        return output, loss_func

    return forward_step


class CountingIterator:
    """An encoder rank's data iterator for one step, counting what the runtime takes.  The
    rank forwards microbatches ``m % encoder_dp == e`` of its slice's ``N``, so the runtime
    pulls items ``0 .. m`` for the last ``m`` it forwards and no further; :meth:`skip_to`
    takes the rest of the step's ``N`` after the step, so the next step starts at its own
    first microbatch on every replica."""

    def __init__(self, iterator: Any) -> None:
        self.iterator, self.taken = iterator, 0

    def __iter__(self) -> "CountingIterator":
        return self

    def __next__(self) -> Any:
        item = next(self.iterator)
        self.taken += 1
        return item

    def skip_to(self, total: int) -> None:
        while self.taken < total:
            next(self)


def slice_losses(store: list, rank: int, last: int, group: Any, encoder: bool) -> list:
    """The slice's loss dicts (its last backbone stage ``last``'s ``forward_data_store``) on
    its encoder ranks too.  An encoder rank is its role's last pipeline stage, so MindSpeed-MM's
    ``train_step`` / ``evaluate`` read the losses there as on the LLM's last stage (for the
    log); the middle backbone stages take part in the broadcast and keep their own (empty) list.
    ``group`` is the whole slice (every TP rank): an encoder TP rank's executor may pair it with
    another TP rank of the backbone than the one it would broadcast from."""
    import torch.distributed as dist

    carried = [store if rank == last else None]
    dist.broadcast_object_list(carried, src=last, group=group)
    return carried[0] if encoder else store


def close() -> None:
    """Close this rank's pool view (the job's end); rank 0 and the pool's participants
    remove what the pools left when they exit (:func:`~mindspeed_flow.pool.job.remove_at_exit`)."""
    from mindspeed_flow.adapters.megatron import decoupled_flow

    if STATE.pool is not None and hasattr(STATE.pool, "close"):
        STATE.pool.close()
    STATE.pool = STATE.executor = None
    decoupled_flow.FLOW = decoupled_flow.FlowState()  # its executor is bound to this job's pipeline group


def _flow_step(layout: Any, rank: int, role: Any, forward_step_func: Callable, iterator: Any, model: Any,
               num_microbatches: int, trainable: bool, forward_only: bool, run: Callable[..., Any]) -> tuple[list, Any]:
    """One step of the layout's flow (:mod:`.decoupled_flow`) on this rank: its
    ``forward_data_store`` and token count (an encoder rank's: empty, zero).  A frozen ViT's
    encoder rank then runs ahead into the next step when the job's next call is that
    training step (:func:`~.decoupled_flow.next_is_training_step`)."""
    import torch
    from megatron.training import get_args

    from mindspeed_flow.adapters.megatron import decoupled_flow
    from mindspeed_flow.adapters.megatron.schedule import SETTINGS

    decoupled_flow.check_supported(layout)
    timeout_s = SETTINGS.options.wait.timeout_s
    if role.region == ENCODER_REGION:
        from mindspeed_flow.adapters.megatron.roles import ROLES, encoder_replica

        samples, grouping = decoupled_flow.encoder_step(layout, iterator, num_microbatches, forward_only=forward_only)
        replica = decoupled_flow.grouping_replica(layout, rank) * layout.encoder_dp + encoder_replica()
        replicas_group = ROLES.groups[ENCODER_REGION] if layout.encoder_dp > 1 else None  # one slice's replicas
        decoupled_flow.produce(samples, grouping, forward_step_func, model, STATE.pool, replica=replica,
                               trainable=trainable, timeout_s=timeout_s, replicas_group=replicas_group,
                               max_in_flight=layout.flow_max_in_flight)
        if not trainable and not forward_only and decoupled_flow.next_is_training_step(get_args()):
            decoupled_flow.run_ahead(layout, iterator, num_microbatches)
        return [], torch.zeros([], dtype=torch.int)
    samples, grouping = decoupled_flow.step_grouping(layout, iterator, num_microbatches)
    executor = decoupled_flow.backbone_executor(layout, rank, SETTINGS.options)
    result = decoupled_flow.consume(samples, grouping, forward_step_func, model, STATE.pool, stage=role.stage,
                                    trainable=trainable, timeout_s=timeout_s,
                                    replica=decoupled_flow.grouping_replica(layout, rank),
                                    run=lambda plan, step_func, bindings: run(plan, step_func, bindings, executor))
    return result.forward_data_store, result.total_num_tokens


def decoupled_forward_backward(*, forward_step_func: Callable, data_iterator: Any, model: Any, num_microbatches: int,
                               forward_only: bool = False, collect_non_loss_data: bool = False,
                               **ignored: Any) -> list:
    """Megatron's ``forward_backward_func`` keywords; this rank's program of its slice's plan."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    from mindspeed_flow.adapters.megatron.roles import ROLES
    from mindspeed_flow.decoupled.plan import slice_plan
    from mindspeed_flow.adapters.megatron.schedule import _grad_sync_held
    from mindspeed_flow.runtime import Binding, LossRules

    layout, groups = ROLES.layout, ROLES.groups
    rank = dist.get_rank()
    role = layout.role(rank)
    encoder = role.region == ENCODER_REGION
    models = list(model) if isinstance(model, list) else [model]
    if len(models) != 1:
        raise ValueError(f"the decoupled layout runs one model chunk per rank, got {len(models)}")
    iterator = data_iterator[0] if isinstance(data_iterator, list) else data_iterator
    slice_microbatches = num_microbatches * layout.encoder_dp if encoder else num_microbatches
    trainable = trainable_encoder()
    executor = _executor(layout, groups)
    config = get_model_config(models[0])
    loss = LossRules(config.calculate_per_token_loss, parallel_state.get_context_parallel_world_size(),
                     config.grad_scale_func)
    if encoder:
        forward_step_func = in_params_dtype(forward_step_func, config.params_dtype)

    def run(plan: Any, step_func: Callable, bindings: dict, on: Any = executor) -> Any:
        with _grad_sync_held(config, forward_only) as release:
            return on.run(plan, step_func, bindings, forward_only=forward_only,
                          collect_non_loss_data=collect_non_loss_data, loss=loss, before_last_backward=release)

    if layout.flow:
        forward_data_store, total_num_tokens = _flow_step(layout, rank, role, forward_step_func, iterator, models[0],
                                                          slice_microbatches, trainable and not forward_only,
                                                          forward_only, run)
    else:
        key = (slice_microbatches, trainable)
        plan = STATE.plans.get(key)
        if plan is None:
            plan = STATE.plans[key] = slice_plan(layout, slice_microbatches, trainable)
        if encoder:
            iterator = CountingIterator(iterator)
        result = run(plan, forward_step_func, {role.binding: Binding(models[0], iterator)})
        if encoder:
            iterator.skip_to(slice_microbatches)
        forward_data_store, total_num_tokens = result.forward_data_store, result.total_num_tokens
    last = layout.backbone_rank(layout.replica(rank), layout.backbone_pp - 1)  # the slice's last stage, TP rank 0
    store = slice_losses(forward_data_store, rank, last, groups["slice"], encoder)
    if forward_only:
        return store
    tokens = total_num_tokens.clone().to(torch.int64 if not total_num_tokens.is_floating_point()
                                         else total_num_tokens.dtype)
    dist.broadcast(tokens, src=last, group=groups["slice"])  # the slice's count, on every rank of it
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func(models, tokens if config.calculate_per_token_loss else None)
    return store
