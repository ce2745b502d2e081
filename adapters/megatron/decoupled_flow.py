"""FlowTrain's flow in Megatron's / MindSpeed-MM's job: the decoupled layout with ``flow: true``.

The lockstep decoupled step (:mod:`.decoupled_step`) has encoder replica ``m % encoder_dp``
encode exactly LLM microbatch ``m`` and put it whole.  Under the flow, one step on a slice:

- every rank of the slice reads the step's ``N`` microbatches from its data iterator (the
  plugin's loader hands every rank of a slice its first stage's packs) and cuts them into
  the same samples (:class:`~mindspeed_flow.adapters.mindspeed_mm.flow_batches.StepBatches`);
  :func:`~mindspeed_flow.flow.packed.group_packed` keeps the microbatches as the backbone's
  and cuts the samples with images, in the order the backbone needs them, into the
  encoder's batches by the encoder's own cost (``flow_encoder_cost``: ViT patches by
  default, or a calibrated ``EncoderCost``; a batch costs at most one image of
  ``flow_encoder_batch_patches`` patches): the two groupings differ; with ``flow_repack``
  the backbone's microbatches are made by the flow's scheduler instead, from the samples by
  the LLM's cost model (:func:`repack`: :func:`~mindspeed_flow.flow.group_step`), each
  joined as the loader joins a pack; with
  several backbone replicas (the layout ``deals_over_slices``) every rank gathers the step's
  microbatches of every slice from its role's data-parallel peers (:func:`every_slices_batches`)
  and the samples of all slices are packed together and dealt zig-zag over PP x DP: a sample
  read, and encoded, in one slice may be trained in another, through the one pool the slices
  share;
- the encoder rank is an :class:`~mindspeed_flow.flow.EmbeddingProducer`: it runs MindSpeed-MM's
  ``forward_step`` on each of its batches (the ViT + projector of ``VLMModel``) and puts one
  pool entry per sample (``flow/step<n>/act/<id>``); a trainable ViT then takes each
  sample's embedding gradient back and runs a batch's backward once all its samples' are in
  (within the step: its weights change at the step boundary); a frozen ViT's producer is
  kept across steps and, when the job's next call is the next training step, reads that
  step's microbatches and encodes them ahead while the pool has room, never waiting
  (:func:`run_ahead`; the next call only puts them, :func:`encoder_step`); a checkpoint holds
  the backbone's loader position, so what was encoded ahead is encoded again after a resume;
- the backbone runs its pipeline's plain 1F1B (:func:`~mindspeed_flow.flow.backbone_plan`)
  on the runtime's executor over Megatron's pipeline group (the backbone's ranks only); its
  first stage's feed takes each microbatch's samples' embeddings by key right before the
  microbatch's forward (:class:`~mindspeed_flow.flow.EmbeddingConsumer`) and hands them to
  ``VLMModel`` (``set_input_tensor``), whose backward puts each sample's gradient back.

The step ends as the lockstep one does: the slice's loss dicts and token count broadcast
from its last stage, then Megatron's ``finalize_model_grads``.  Same samples, same loss,
same gradients as the lockstep step; only the encoder's grouping differs.

What it does not run yet is refused at start-up (:func:`check_supported`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from mindspeed_flow.decoupled import LayoutError
from mindspeed_flow.flow.errors import StreamError
from mindspeed_flow.schedule.regions import BACKBONE_REGION, ENCODER_REGION

log = logging.getLogger(__name__)


@dataclass
class FlowState:
    """Across steps: the flow's step count (keys ``flow/step<n>/...``; every rank of a slice
    calls the step as often), the backbone pipeline's executor, and what this rank did in
    the latest step (``last``: the two groupings' sample ids; the encoder's forwards and
    backwards, the first stage's samples taken and gradients put), for tests and logs.

    On an encoder rank also its :class:`~mindspeed_flow.flow.EmbeddingProducer` (``producer``,
    kept across steps: what a frozen ViT encoded ahead is put by the next step's), the steps'
    samples it may still encode or put (``samples``, by step) and the next step it read and
    ran ahead into (``ahead``: its samples and grouping; the counter ``steps`` already counts
    it, so the next call takes it instead of reading the data iterator again)."""

    steps: int = 0
    executor: Any = None
    last: dict | None = None
    producer: Any = None
    samples: dict = field(default_factory=dict)
    ahead: tuple[Any, Any] | None = None


FLOW = FlowState()


def check_supported(layout: Any, args: Any = None, source: str = "the decoupled layout",
                    backend: str | None = None) -> None:
    """Refuse (:class:`LayoutError`, naming ``source`` and each reason) a flow layout this
    version does not run: several backbone replicas with several encoder replicas each,
    tensor parallelism in either role (untensored ranks are what is checked in Megatron's
    job), virtual pipeline stages, slices that deal samples to each other on the ``torch``
    pool ``backend`` (a process group per slice's pool); and ``flow_repack`` without
    ``--calculate-per-token-loss`` (given ``args``)."""
    reasons = []
    if layout.backbone_dp > 1 and layout.encoder_dp > 1:
        reasons.append(f"backbone dp {layout.backbone_dp} with {layout.encoder_dp} encoder replicas per slice (the "
                       "replicas' gradient sum runs over every encoder rank, not one slice's)")
    if layout.encoder_tp > 1 or layout.backbone_tp > 1:
        reasons.append(f"tensor parallelism (encoder tp {layout.encoder_tp}, backbone tp {layout.backbone_tp}: the "
                       "per-sample entries are read and written by one rank per role)")
    if args is not None and getattr(args, "virtual_pipeline_model_parallel_size", None):
        reasons.append("virtual pipeline stages (the backbone runs one model chunk per rank)")
    if layout.deals_over_slices and backend == "torch":
        reasons.append(f"flow_repack over {layout.backbone_dp} backbone replicas on the torch pool backend (its pool "
                       "is a process group per slice, and these slices share one pool: use shm on one node, "
                       "mooncake across nodes)")
    if reasons:
        raise LayoutError(f"{source}: decoupled.flow does not run here yet: " + "; ".join(reasons))
    if layout.flow_repack and args is not None and not getattr(args, "calculate_per_token_loss", False):
        raise LayoutError(f"{source}: decoupled.flow_repack regroups each step's samples into other LLM microbatches "
                          "than the loader's packs, which trains the same loss and gradients only with "
                          "--calculate-per-token-loss (a microbatch's mean loss weighs each token by its "
                          "microbatch's token count); add --calculate-per-token-loss or drop flow_repack")


def image_token_id() -> int:
    """The image token of MindSpeed-MM's model config (``img_context_token_id``)."""
    from megatron.training import get_args

    model = get_args().mm.model
    token = getattr(model, "img_context_token_id", None)
    if token is None:
        token = getattr(model, "image_token_id", None)
    if token is None:
        raise LayoutError("decoupled.flow: the model config has no img_context_token_id to find each sample's "
                          "image tokens")
    return int(token)


def step_grouping(layout: Any, iterator: Any, num_microbatches: int) -> tuple[Any, Any]:
    """This step's samples and grouping, from its ``num_microbatches`` microbatches (read now;
    when the layout ``deals_over_slices``, with every slice's: :func:`every_slices_batches`):
    the loader's packs as the backbone's microbatches, or with ``flow_repack`` new ones
    (:func:`repack`)."""
    from mindspeed_flow.adapters.mindspeed_mm.flow_batches import StepBatches
    from mindspeed_flow.flow.packed import group_packed

    batches = [next(iterator) for _ in range(num_microbatches)]
    replicas = dealt_replicas(layout)
    if replicas > 1:
        batches = every_slices_batches(layout, batches)
    samples = StepBatches(FLOW.steps, batches, image_token_id())
    FLOW.steps += 1
    encoder = {"encoder_cost": layout.flow_encoder_model, "encoder_budget": layout.flow_encoder_budget,
               "encoder_replicas": layout.encoder_dp * replicas, "pp": layout.backbone_pp}
    if layout.flow_repack:
        return samples, repack(samples, iterator, encoder, replicas)
    return samples, group_packed(samples.metas, samples.microbatches, **encoder)


def every_slices_batches(layout: Any, batches: list) -> list:
    """The step's microbatches of every slice, slice by slice: each slice's ranks read their
    own share of the data (Megatron's data parallelism), and a layout that
    ``deals_over_slices`` packs all of them together.  Gathered over this rank's role's
    data-parallel group (every encoder rank; this backbone stage of every slice), so every
    rank of the job holds the same samples and makes the same grouping."""
    import torch.distributed as dist

    from mindspeed_flow.adapters.megatron.roles import ROLES

    rank = dist.get_rank()
    group = ROLES.groups["vit_dp" if layout.role(rank).region == ENCODER_REGION else "llm_dp"]
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (layout.replica(rank), batches), group=group)
    order = [replica for replica, _ in gathered]
    if order != list(range(layout.backbone_dp)):
        raise StreamError(f"decoupled.flow: rank {rank} gathered the step's microbatches of slices {order} over its "
                          f"data-parallel group, expected each of the {layout.backbone_dp} slices once, in order")
    return [batch for _, theirs in gathered for batch in theirs]


def dealt_replicas(layout: Any) -> int:
    """The backbone replicas a step's samples are dealt over: every one when the layout
    ``deals_over_slices``, else the slice's own."""
    return layout.backbone_dp if layout.deals_over_slices else 1


def grouping_replica(layout: Any, rank: int) -> int:
    """The backbone replica of ``rank``'s slice in the step's grouping: the slice's index when
    the layout ``deals_over_slices`` (the grouping holds every slice's samples), else 0 (the
    grouping is its slice's alone)."""
    return layout.replica(rank) if layout.deals_over_slices else 0


def repack(samples: Any, iterator: Any, encoder: dict, replicas: int = 1) -> Any:
    """The step's samples packed again into as many LLM microbatches as the loader made
    (Megatron's count for the step, on each of the ``replicas`` backbone replicas the samples
    are dealt over): best-fit and filled by the job's packing loader's cost model (its
    ``sum l^2`` term), the loader's own packs weighed as one more candidate (so the step is
    never dearer than the loader's by that model, and a step the greedy fill cannot fit keeps
    them), dealt zig-zag over the replicas' pipeline stages
    (:func:`~mindspeed_flow.flow.group_step`), each pack joined as the loader joins one
    (:meth:`~mindspeed_flow.adapters.mindspeed_mm.flow_batches.StepBatches.repack`).  Every
    rank dealt over holds the same samples and makes the same packs."""
    from megatron.training import get_args

    from mindspeed_flow.adapters.mindspeed_mm.flow_batches import pack_settings
    from mindspeed_flow.flow import group_step

    settings = pack_settings(iterator, get_args().seq_length)
    loader_packs = [list(mb) for mb in samples.microbatches]
    grouping = group_step(samples.metas, capacity=settings.capacity, llm_cost=settings.cost_model,
                          microbatches=len(loader_packs), candidates=[loader_packs], dp=replicas, **encoder)
    samples.repack(grouping.microbatches, settings.multiple)
    log.info("mindspeed-flow flow: step %d: the loader's packs %s repacked into LLM microbatches %s (sample ids)"
             " on backbone replicas %s", samples.step, loader_packs, [list(mb) for mb in grouping.microbatches],
             list(grouping.microbatch_replica))
    return grouping


def encoder_step(layout: Any, iterator: Any, num_microbatches: int, *, forward_only: bool) -> tuple[Any, Any]:
    """An encoder rank's step: the one it read and ran ahead into during the previous call
    (its microbatches are not read again), else :func:`step_grouping`'s.

    An evaluation where the held step was expected (MindSpeed-MM's last validation after a
    sample budget ended training early: ``train_iters`` shrinks after the step that ran
    ahead) drops that step (:func:`drop_ahead`): its number is the evaluation's on the
    backbone.  A training step of another microbatch count is refused: nothing foreseen
    changes the count."""
    if FLOW.ahead is not None and forward_only:
        drop_ahead()
    if FLOW.ahead is None:
        return step_grouping(layout, iterator, num_microbatches)
    (samples, grouping), FLOW.ahead = FLOW.ahead, None
    held = len(samples.loader_microbatches) // dealt_replicas(layout)  # a slice's
    if held != num_microbatches:
        raise StreamError(f"decoupled.flow: the encoder ran ahead into step {samples.step} ({held} microbatches a "
                          f"slice), but the job's next training step has {num_microbatches} microbatches "
                          "(next_is_training_step foresaw it wrong)")
    return samples, grouping


def drop_ahead() -> None:
    """Give up the step this rank ran ahead into: its entries leave the pool, its number is
    the next call's again.  The microbatches it read are not trained: the checkpoint's
    loader position (the slice's first backbone stage's) never included them."""
    (samples, _), FLOW.ahead = FLOW.ahead, None
    dropped = FLOW.producer.discard(samples.step)
    FLOW.samples.pop(samples.step, None)
    FLOW.steps = samples.step
    log.info("mindspeed-flow flow: dropped step %d, run ahead into (%d entries): the job's next call is an "
             "evaluation", samples.step, dropped)


def next_is_training_step(args: Any) -> bool:
    """Whether the job's next ``forward_backward_func`` call is its next training step, of
    the same microbatch count, on the same data iterator, as far as Megatron's / MindSpeed-MM's
    ``train`` loop lets one foresee it: not after the last iteration (``train_iters``), nor
    before an evaluation (after iteration ``i`` when ``do_valid`` and ``i % eval_interval
    == 0``) or an exit (``i % exit_interval == 0``), nor under a batch-size ramp-up,
    ``--use-data-balance`` (which rebuilds the iterator every step), MindSpeed-MM's dynamic
    DP/CP (which reads the iterator before the step) or Megatron's rerun machinery
    (``--rerun-mode`` other than ``disabled``: it may replay a step on a rewound iterator).
    Without ``curr_iteration`` (no train loop set it): no.  What cannot be foreseen (a
    sample budget reached, an exit signal) ends with the held step unused or dropped
    (:func:`encoder_step`)."""
    current, total = getattr(args, "curr_iteration", None), getattr(args, "train_iters", None)
    if current is None or total is None:
        return False
    done = current + 1
    evaluates = getattr(args, "do_valid", False) and getattr(args, "eval_interval", None) and \
        done % args.eval_interval == 0
    exits = getattr(args, "exit_interval", None) and done % args.exit_interval == 0
    model = getattr(getattr(args, "mm", None), "model", None)
    changes = getattr(args, "rampup_batch_size", None) or getattr(args, "use_data_balance", False) or \
        getattr(model, "use_dynamic_dpcp", False) or getattr(args, "rerun_mode", "disabled") != "disabled"
    return done < total and not evaluates and not exits and not changes


def produce(samples: Any, grouping: Any, forward_step_func: Callable, model: Any, pool: Any, *,
            replica: int, trainable: bool, timeout_s: float, replicas_group: Any = None,
            max_in_flight: int | None = None) -> None:
    """Encoder replica ``replica``'s step (its index in the grouping's encoder replicas):
    its batches encoded and put per sample (those a frozen ViT encoded ahead in the previous
    step only put); a trainable ViT's backwards as the gradients come back, then (several
    replicas in the slice) the sum of the slice's replicas' gradients over ``replicas_group``.
    Encoder ranks of several slices that deal over slices are not summed here: each holds
    its own batches' part, and Megatron's DDP sums the parts over the role's data-parallel
    group.  The step's counts go to ``FLOW.last``; the producer, kept for the
    job, forgets its records of the step."""
    producer = _producer(pool, forward_step_func, model, replica=replica, trainable=trainable, timeout_s=timeout_s,
                         max_in_flight=max_in_flight)
    FLOW.samples[samples.step] = samples
    producer.forward(grouping)
    if trainable:
        producer.backward(grouping)
        if replicas_group is not None:
            sum_replica_grads(model, replicas_group)
    FLOW.samples = {step: s for step, s in FLOW.samples.items() if step > samples.step}
    forwards, backwards = producer.stats.step_counts(grouping.step)
    producer.stats.forget_through(grouping.step)
    FLOW.last = {**_groups(grouping), "forwards": forwards, "backwards": backwards}
    log.info("mindspeed-flow flow: step %d: LLM microbatches %s, encoder batches %s (sample ids)",
             samples.step, [list(mb) for mb in grouping.microbatches], [list(b) for b in grouping.batches])


def run_ahead(layout: Any, iterator: Any, num_microbatches: int) -> int:
    """A frozen ViT's encoder rank after its step: read the next step's microbatches, group
    them and encode this replica's batches of it while their entries fit
    (:meth:`~mindspeed_flow.flow.EmbeddingProducer.run_ahead`: never waits, so the step's end
    cannot deadlock); the next call produces that step (:func:`encoder_step`).  Call it only
    when :func:`next_is_training_step`.  Returns the batches encoded."""
    samples, grouping = step_grouping(layout, iterator, num_microbatches)
    FLOW.ahead = samples, grouping
    FLOW.samples[samples.step] = samples
    done = FLOW.producer.run_ahead(grouping)
    mine = len(grouping.replica_batches(FLOW.producer.replica))
    FLOW.last = {**(FLOW.last or {}), "ahead_step": samples.step, "ahead_batches": done, "ahead_of": mine}
    log.info("mindspeed-flow flow: step %d: ran ahead into step %d: %d of %d batches", samples.step - 1,
             samples.step, done, mine)
    return done


def _producer(pool: Any, forward_step_func: Callable, model: Any, *, replica: int, trainable: bool,
              timeout_s: float, max_in_flight: int | None) -> Any:
    """This rank's producer, kept across steps (a new one when the ViT's trainability for the
    call changes: an evaluation of a trainable ViT); its ``encode`` runs this call's
    ``forward_step_func`` on a batch of the samples' step."""
    from mindspeed_flow.flow import EmbeddingProducer

    def encode(metas: Any) -> Any:
        output, _ = forward_step_func(iter([FLOW.samples[metas[0].step].encoder_input(metas)]), model)
        return output.reshape(-1, output.shape[-1])

    producer = FLOW.producer
    if producer is None or producer.trainable != trainable:
        producer = FLOW.producer = EmbeddingProducer(pool, encode, replica=replica, trainable=trainable,
                                                     max_in_flight=max_in_flight, timeout_s=timeout_s)
    producer.encode = encode
    return producer


def sum_replica_grads(model: Any, group: Any) -> None:
    """Every encoder replica of the slice holds the sum of their gradients (DDP's ``main_grad``),
    as the lockstep plan's ``REDUCE`` leaves them: each encoded other samples, and Megatron's
    DDP then averages over ``encoder_dp`` equal copies with the matching divisor
    (:mod:`.decoupled_step`)."""
    import torch.distributed as dist

    from mindspeed_flow.flat_grads import flatten_grads, set_accumulated_grads

    params = [p for p in model.parameters() if p.requires_grad]
    flat = flatten_grads(params)
    dist.all_reduce(flat, group=group)
    set_accumulated_grads(params, flat)


def consume(samples: Any, grouping: Any, forward_step_func: Callable, model: Any, pool: Any, *, stage: int,
            trainable: bool, timeout_s: float, run: Callable[..., Any], replica: int = 0) -> Any:
    """A backbone stage's step: its pipeline's 1F1B over backbone replica ``replica``'s
    microbatches of the step (the loader's packs, or :func:`repack`'s), the first stage's
    embeddings taken per sample from the pool.  ``run(plan, forward_step, bindings)`` runs
    the executor (the caller holds Megatron's gradient-sync contract); returns its result."""
    from mindspeed_flow.flow import EmbeddingConsumer, backbone_plan, stage_feed
    from mindspeed_flow.runtime import Binding
    from mindspeed_flow.runtime.step import set_input_tensor

    consumer = None
    if stage == 0:
        device = next(model.parameters()).device
        consumer = EmbeddingConsumer(pool, trainable=trainable, device=device, timeout_s=timeout_s)
    feed = zip(stage_feed(grouping, replica, consumer),
               (samples.batch(m) for m in grouping.replica_microbatches(replica)))

    def forward_step(data_iterator: Any, chunk: Any) -> Any:
        item, batch = next(data_iterator)
        if item.embeddings is not None:  # the first stage: the samples' embeddings, in the pack's order
            set_input_tensor(chunk, [item.embeddings.reshape(-1, 1, item.embeddings.shape[-1])])
        return forward_step_func(iter([batch]), chunk)

    result = run(backbone_plan(grouping), forward_step, {(BACKBONE_REGION, stage): Binding(model, feed)})
    FLOW.last = {**_groups(grouping), "replica": replica}
    if consumer is not None:
        consumer.finish(grouping, replica)
        FLOW.last.update(taken=len(consumer.stats.taken), grads_put=len(consumer.stats.grads_put))
    return result


def _groups(grouping: Any) -> dict:
    return {"step": grouping.step, "microbatches": [list(mb) for mb in grouping.microbatches],
            "microbatch_replica": list(grouping.microbatch_replica), "batches": [list(b) for b in grouping.batches],
            "batch_replica": list(grouping.batch_replica)}


def backbone_executor(layout: Any, rank: int, options: Any) -> Any:
    """The executor of this backbone rank's pipeline (Megatron's pipeline group: under the
    decoupled layout, the backbone's stages only)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mindspeed_flow.runtime import Executor

    if FLOW.executor is None:
        group = parallel_state.get_pipeline_model_parallel_group()
        ranks = dist.get_process_group_ranks(group)
        FLOW.executor = Executor(ranks.index(rank), ranks, group, options=options)
    return FLOW.executor
