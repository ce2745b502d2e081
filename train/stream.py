"""The flowtrain run as FlowTrain's flow (``layout.flow: true``): a thin caller of the core's
runtime (:mod:`mindspeed_flow.flow`).

The same ranks as the lockstep decoupled run (:func:`~mindspeed_flow.train.flow.flow_layout`:
the allocator's plan or the config's sizes), placed as :class:`~mindspeed_flow.flow.FlowRanks`
(encoder replicas first, then every backbone replica's stages).  Every rank cuts the step's
packs into samples and groups them with :func:`~mindspeed_flow.flow.group_step` (pure, so
all agree): the encoder's batches by its cost (``data.encoder_cost``, patches by default), the
backbone's microbatches packed *after* encoding by the LLM's cost (``data.llm_cost``), zig-zag
over PP x DP.

- ViT ranks are :class:`~mindspeed_flow.flow.EmbeddingProducer`\\ s: one pool entry per
  sample.  Trainable: forward and backward within the step (gradients come back through the
  pool), then the sum over the encoder replicas.  Frozen (``model.freeze_vit``): after this
  step's batches, :meth:`~mindspeed_flow.flow.EmbeddingProducer.run_ahead` encodes the next
  step's (the feed hands every rank the next step's data) while the pool has room, so the
  backbone's next step starts with its embeddings ready.
- Backbone ranks run each replica's 1F1B on the executor (:func:`~mindspeed_flow.flow.backbone_plan`),
  stage 0 fed by :class:`~mindspeed_flow.flow.EmbeddingConsumer` through
  :func:`~mindspeed_flow.flow.stage_feed`; each microbatch's samples are joined into one
  packed varlen batch.  Gradients are summed over each stage's replicas (per-token step loss:
  no division).

Checkpoints hold what any trainer's hold; entries a frozen producer put ahead are not in
them: the feed's position is right after the saved step, so a resumed run encodes them
again (:attr:`StreamTrainer.ahead` lists them at save time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mindspeed_flow.adapters.megatron.parallel import destroy_model_parallel
from mindspeed_flow.flow import EncoderCost, FlowGrouping, FlowRanks, SampleMeta, group_step
from mindspeed_flow.flow.encoder_cost import PATCHES
from mindspeed_flow.packing import CostModel
from mindspeed_flow.schedule.regions import BACKBONE_REGION, ENCODER_REGION
from mindspeed_flow.train.backbone import enable_fused_attn
from mindspeed_flow.train.batches import PackSample, join_samples, split_pack
from mindspeed_flow.train.flow import ALLOCATOR_FEATURE, flow_layout, pool_bytes, pool_name
from mindspeed_flow.train.stamps import executor_intervals
from mindspeed_flow.train.trainer import LocalStep, Trainer

if TYPE_CHECKING:
    from mindspeed_flow.train.config import TrainConfig
    from mindspeed_flow.train.feed import StepData
    from mindspeed_flow.train.launch import DistEnv

MERGED = 4  # ViT patches per image token (2x2 merger)


def group_samples(metas: "list[SampleMeta]", cfg: "TrainConfig", ranks: FlowRanks, llm_cost: CostModel,
                  encoder_cost: EncoderCost = PATCHES) -> FlowGrouping:
    """One step's two groupings on ``ranks``: the encoder's batches by ``encoder_cost``
    (``cfg.data.encoder_cost_model()``: ``data.encoder_cost``, calibrated or patches), each
    costing at most one image of ``layout.flow_encoder_batch_patches`` patches; the backbone's
    microbatches by ``llm_cost`` (``cfg.data.llm_cost_model()``: ``data.llm_cost``,
    calibrated or the loader's default)."""
    return group_step(metas, capacity=cfg.data.capacity, llm_cost=llm_cost, encoder_cost=encoder_cost,
                      encoder_budget=encoder_cost.image_cost(cfg.layout.flow_encoder_batch_patches),
                      encoder_replicas=ranks.encoder_replicas, dp=ranks.dp, pp=ranks.pp)


class StepSamples:
    """One step's samples, cut out of its packs, with the flow's metadata (sample id = the
    sample's index in the step)."""

    def __init__(self, data: "StepData", image_token_id: int) -> None:
        self.step = data.step
        self.loss_tokens = data.loss_tokens
        self.samples: list[PackSample] = [s for pack in data.packs for s in split_pack(pack, image_token_id)]
        self.metas = [SampleMeta(i, data.step, len(s.input_ids), int(s.image_grid_thw.prod(dim=1).sum()) // MERGED,
                                 tuple(int(p) for p in s.image_grid_thw.prod(dim=1)))
                      for i, s in enumerate(self.samples)]

    def batch(self, sample_ids: Any) -> Any:
        """The samples ``sample_ids`` joined into one packed varlen :class:`ModelBatch`."""
        return join_samples([self.samples[i] for i in sample_ids], self.loss_tokens)


class StreamTrainer(Trainer):
    """The flowtrain run as FlowTrain's flow on this rank (see the module)."""

    name = "flowtrain"
    features = ("packing loader", ALLOCATOR_FEATURE, "flow: per-sample pool, packing after encoding",
                "varlen attention", "Conv->Matmul")

    def __init__(self, cfg: "TrainConfig", env: "DistEnv", *, parity: bool = False) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        from mindspeed_flow.flow import EmbeddingConsumer, EmbeddingProducer
        from mindspeed_flow.pool import open_pool
        from mindspeed_flow.runtime import Executor
        from mindspeed_flow.train.model import StageModule, build_gpt_stage, init_vision_encoder

        super().__init__(cfg, env, parity=parity)
        chosen = flow_layout(cfg, env.world_size)
        d = chosen.decoupled
        self.ranks = ranks = FlowRanks(d.encoder_dp * d.backbone_dp, d.backbone_dp, d.backbone_pp)
        if ranks.encoder_replicas % ranks.pp:
            raise ValueError(f"layout.flow: {ranks.encoder_replicas} encoder ranks before the backbone would split "
                             f"Megatron's pipelines of {ranks.pp} ranks (the encoder replicas must be a multiple "
                             "of the backbone's pipeline size)")
        self.frozen = cfg.model.freeze_vit
        self.llm_cost = cfg.data.llm_cost_model()  # data.llm_cost: its file is read once, here
        self.encoder_cost = cfg.data.encoder_cost_model()  # data.encoder_cost: likewise
        self.timeline_from_end = 2 if self.frozen else 1  # the last step has no next step to run ahead into
        self.plan_text = chosen.plan_text
        self.layout = (f"ViT DP={ranks.encoder_replicas} (flow, {'frozen: runs ahead' if self.frozen else 'trainable'})"
                       f" | LLM PP={ranks.pp} x DP={ranks.dp}, layers {list(chosen.layer_split)}")
        if not chosen.from_allocator:
            self.features = tuple("layout from the config (no runnable allocator plan, see plan)"
                                  if f == ALLOCATOR_FEATURE else f for f in self.features)
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=ranks.pp, order="tp-cp-ep-pp-dp")
        encoder_group = dist.new_group(ranks.encoder_ranks)
        stage_groups = [dist.new_group(ranks.stage_peers(s)) for s in range(ranks.pp)]
        pipelines = [dist.new_group(ranks.pipeline(r)) for r in range(ranks.dp)]
        self.region, self.replica, self.stage = ranks.role(env.rank)
        self.pool_name = pool_name(env.rank)
        self.pool = open_pool("shm", capacity_bytes=pool_bytes(cfg), name=self.pool_name, owner=f"rank{env.rank}")
        self.producer = self.consumer = self.executor = None
        self._steps: dict[int, StepSamples] = {}  # the step being trained, and the next when running ahead
        self._current = 0
        if self.region == ENCODER_REGION:
            self.model = init_vision_encoder(cfg.model, conv_matmul=True, varlen=True).to(env.device)
            self.role = f"ViT replica {self.replica} (flow producer)"
            self.grad_group = encoder_group
            self.producer = EmbeddingProducer(self.pool, self._encode, replica=self.replica,
                                              trainable=not self.frozen, max_in_flight=cfg.layout.flow_max_in_flight,
                                              record=self._record)
        else:
            gpt = build_gpt_stage(cfg.model, list(chosen.layer_split), self.stage, packed=True)
            self.model = StageModule(gpt).to(env.device)
            self.role = f"LLM pp{self.stage} dp{self.replica}" + (" (flow consumer)" if self.stage == 0 else "")
            self.grad_group = stage_groups[self.stage]
            if self.stage == 0:
                self.consumer = EmbeddingConsumer(self.pool, trainable=not self.frozen, device=env.device)
            self.executor = Executor(self.stage, ranks.pipeline(self.replica), group=pipelines[self.replica])
        self.modules = {self.region: self.model}
        self.fused_attn = enable_fused_attn()
        dist.barrier()  # every participant's pool is open before the first put
        self.make_optimizer()

    # ------------------------------------------------------------------ the step

    def grouping(self, samples: StepSamples) -> FlowGrouping:
        """The step's two groupings (every rank computes the same)."""
        return group_samples(samples.metas, self.cfg, self.ranks, self.llm_cost, self.encoder_cost)

    def forward_backward(self, data: "StepData") -> LocalStep:
        image_token = self.cfg.model.image_token_id
        samples = self._steps.get(data.step) or StepSamples(data, image_token)
        self._steps, self._current = {data.step: samples}, data.step
        grouping = self.grouping(samples)
        if self.producer is not None:
            self.producer.forward(grouping)
            if not self.frozen:
                self.producer.backward(grouping)
            elif data.ahead is not None:  # the next step's batches, while the pool has room
                ahead = self._steps[data.ahead.step] = StepSamples(data.ahead, image_token)
                self.producer.run_ahead(self.grouping(ahead))
            return LocalStep(0.0, 0)
        return self._backbone_step(samples, grouping)

    def _backbone_step(self, samples: StepSamples, grouping: FlowGrouping) -> LocalStep:
        from mindspeed_flow.flow import backbone_plan, stage_feed
        from mindspeed_flow.runtime import Binding
        from mindspeed_flow.train.model import forward_step, loss_rules

        first, device = self.stage == 0, self.env.device

        def flow_forward_step(data_iterator: Any, model: Any) -> Any:
            item = next(data_iterator)
            if first:  # this microbatch's image embeddings (None: it has no image)
                model.set_input_tensor([item.embeddings])
            return forward_step(iter([samples.batch(item.sample_ids).to(device)]), model)

        feed = stage_feed(grouping, self.replica, self.consumer)
        result = self.executor.run(backbone_plan(grouping), flow_forward_step,
                                   {(BACKBONE_REGION, self.stage): Binding(self.model, feed)}, loss=loss_rules())
        if self.consumer is not None:
            self.consumer.finish(grouping, self.replica)
        executor_intervals(self.stamps, result.timeline)
        mine = [m for k in grouping.replica_microbatches(self.replica) for m in grouping.microbatches[k]]
        last = self.stage == self.ranks.pp - 1
        loss = sum(float(item["loss"]) for item in result.forward_data_store) if last else 0.0
        return LocalStep(loss, sum(samples.metas[i].llm_tokens for i in mine) if first else 0)

    def reduce_grads(self) -> None:
        from mindspeed_flow.flat_grads import all_reduce_flat_grads

        params = self.parameters()
        if params:  # a frozen ViT has nothing to sum
            with self.stamps.timed(self.region, "REDUCE"):
                all_reduce_flat_grads(params, self.grad_group)

    # ------------------------------------------------------------------ the producer's side

    def _encode(self, metas: Any) -> Any:
        """The ViT over an encoder batch's samples (their pixels from the step's packs)."""
        samples = self._steps[metas[0].step]
        return self.model(samples.batch([m.sample_id for m in metas]).to(self.env.device))

    def _record(self, kind: str, step: int, batch: int, start: float, end: float) -> None:
        """A producer action as an interval of the step running now (``ahead``: of a later one)."""
        self.stamps.add(ENCODER_REGION, kind, batch, start, end, ahead=step - self._current)

    @property
    def ahead(self) -> list[str]:
        """Pool keys of later steps a frozen producer encoded and the backbone has not taken."""
        return self.producer.ahead if self.producer is not None else []

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["ahead_not_saved"] = self.ahead  # encoded again after a resume (the feed's position is this step's)
        return state

    def close(self) -> None:
        import torch.distributed as dist

        from mindspeed_flow.pool.shm import destroy

        try:
            if self.producer is not None:
                self.producer.wait_taken()
        finally:
            self.pool.close()
            dist.barrier()  # nobody reads the pool any more
            if self.env.rank == 0:
                destroy(self.pool_name)
            if self.fused_attn is not None:
                self.fused_attn.remove()
            destroy_model_parallel()


__all__ = ["StepSamples", "StreamTrainer", "group_samples"]
