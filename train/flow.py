"""The FlowTrain run: packs as microbatches, the allocator's layout, the decoupled schedule
over the memory pool, varlen attention and Conv->Matmul.

Encoder ranks run the ViT (``PatchEmbedMatmul``, varlen attention within each image) and
``PUT`` each microbatch's embeddings into the pool; the backbone ranks are megatron-core's
GPT cut into pipeline stages (packed THD batches through the plugin's ``fused_attn`` patch,
no dense mask), whose first stage ``GET``s the embeddings and ``PUT``s their gradients back
(:class:`~mindspeed_flow.decoupled.DecoupledLayout`, run by
:class:`~mindspeed_flow.runtime.Executor`).  What makes the decoupled step - placement,
groups, plan, gradient averaging, the allocator plan as a layout - is the core's
(:mod:`mindspeed_flow.decoupled`, which the real job's patches call too); this module only
asks the allocator with the tiny model's numbers and builds this rank's modules.  Each backbone replica trains its contiguous
share of the step's packs.  Each microbatch's loss is its share of the step loss and the
executor divides by nothing (``calculate_per_token_loss``, as the baseline's Megatron);
``grad_scale_func`` multiplies by the backbone replica count, which
:meth:`DecoupledLayout.average_grads` divides by, so the gradients are exactly those of the
step loss, as in the baseline.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mindspeed_flow.adapters.megatron.parallel import destroy_model_parallel
from mindspeed_flow.schedule.regions import BACKBONE_REGION, ENCODER_REGION
from mindspeed_flow.train.backbone import enable_fused_attn
from mindspeed_flow.train.stamps import executor_intervals
from mindspeed_flow.train.trainer import LocalStep, Trainer, replica_share

from mindspeed_flow.decoupled import DecoupledLayout, describe_plan, layout_from_plan, unrealisable

if TYPE_CHECKING:
    from mindspeed_flow.train.config import TrainConfig
    from mindspeed_flow.train.feed import StepData
    from mindspeed_flow.train.launch import DistEnv

# The CPU cluster and measured profile the allocator plans the tiny model on.
ALLOCATOR_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "allocator" / "tiny_cpu.yaml"
ALLOCATOR_FEATURE = "allocator plan"
_POOL_MIN_BYTES = 8 << 20
_instances = iter(range(1 << 30))


@dataclass(frozen=True)
class FlowLayout:
    """Where FlowTrain puts the model: the decoupled layout, the LLM layers per backbone
    stage, and how it was chosen (the allocator's plan, or why the config's layout)."""

    decoupled: DecoupledLayout
    layer_split: tuple[int, ...]
    plan_text: str
    from_allocator: bool

    def describe(self) -> str:
        d = self.decoupled
        return (f"ViT DP={d.encoder_dp * d.backbone_dp} (decoupled) | LLM PP={d.backbone_pp} x DP={d.backbone_dp}, "
                f"layers {list(self.layer_split)}")


def flow_layout(cfg: "TrainConfig", world_size: int) -> FlowLayout:
    """The allocator's plan when ``layout.use_allocator``: the best plan a
    :class:`DecoupledLayout` of ``world_size`` ranks runs (the allocator is asked for exactly
    those, :func:`allocator_plan`); otherwise, or when no such plan exists, the config's
    ``flow_encoder_dp`` / ``flow_backbone_pp`` / ``flow_backbone_dp``, with the reason."""
    from mindspeed_flow.train.trainer import even_split

    lay = cfg.layout
    reason = "layout.use_allocator is false"
    if lay.use_allocator:
        plan, reason = allocator_plan(cfg, world_size)
        if plan is not None:
            decoupled = layout_from_plan(plan, max_ahead=lay.max_ahead).with_layers(cfg.model.vit_layers,
                                                                                    cfg.model.llm_layers)
            return FlowLayout(decoupled, tuple(plan.backbone.layer_split),
                              f"allocator plan used: {describe_plan(plan)} ({reason})", from_allocator=True)
    decoupled = DecoupledLayout(encoder_dp=lay.flow_encoder_dp, backbone_pp=lay.flow_backbone_pp,
                                backbone_dp=lay.flow_backbone_dp, max_ahead=lay.max_ahead,
                                encoder_layers=cfg.model.vit_layers, backbone_layers=cfg.model.llm_layers)
    if decoupled.world_size != world_size:
        raise ValueError(f"layout: flow_backbone_dp * (flow_encoder_dp + flow_backbone_pp) = "
                         f"{decoupled.world_size} ranks, but the world has {world_size} (not the allocator's "
                         f"layout because {reason})")
    decoupled.megatron_parallel_kwargs()  # refuses encoder ranks that split Megatron's pipelines
    split = tuple(even_split(cfg.model.llm_layers, decoupled.backbone_pp))
    return FlowLayout(decoupled, split, f"config layout (flow_encoder_dp/flow_backbone_pp/flow_backbone_dp): {reason}",
                      from_allocator=False)


def allocator_problem(cfg: "TrainConfig", world_size: int) -> tuple[Any, Any, Any, Any]:
    """``(model, cluster, proxy, workload)``: the tiny model of ``cfg`` on ``world_size``
    CPU devices of the measured CPU profile (TP 1, one pack per allocator sample), as the
    allocator sees it before the runtime's requirements are added."""
    from mindspeed_flow.allocator import ModelSpec, ModuleSpec, Profile, ProxyModel, load_config

    m = cfg.model
    tokens = cfg.data.capacity  # one allocator sample = one pack
    model = ModelSpec(
        encoder=ModuleSpec(layers=m.vit_layers, hidden=m.vit_hidden, heads=m.vit_heads, ffn=4 * m.vit_hidden,
                           tokens_per_sample=tokens, gated=False),
        backbone=ModuleSpec(layers=m.llm_layers, hidden=m.llm_hidden, heads=m.llm_heads, ffn=m.llm_ffn,
                            tokens_per_sample=tokens, vocab=max(m.vocab_size, 1), gated=False),
        name="tiny VLM (train config)")
    base = load_config(ALLOCATOR_CONFIG)
    cluster = replace(base.cluster, devices=world_size)
    workload = replace(base.workload, global_batch=cfg.data.packs_per_step, tp_choices=(1,), alternatives=0)
    return model, cluster, ProxyModel(Profile.load(base.profile), cluster), workload


def allocator_plan(cfg: "TrainConfig", world_size: int) -> tuple[Any, str]:
    """The allocator's best plan among those a :class:`DecoupledLayout` of ``world_size``
    CPU ranks runs - decoupled, Megatron's ``tp x pp`` blocks, every rank - with what the
    best plan without those requirements would have been; ``(None, the allocator's
    diagnosis)`` when no plan meets them."""
    from mindspeed_flow.allocator import AllocatorError, InfeasibleError, solve

    if not ALLOCATOR_CONFIG.is_file():
        return None, f"the allocator's CPU profile config {ALLOCATOR_CONFIG} is not there (installed without configs/)"
    try:
        model, cluster, proxy, workload = allocator_problem(cfg, world_size)
        runnable = replace(workload, placements=("decoupled",), megatron_blocks=True, exact_devices=True)
        plan = solve(model, cluster, proxy, runnable)
        free = solve(model, cluster, proxy, workload)
    except (InfeasibleError, AllocatorError, OSError) as exc:
        return None, f"the allocator found no plan this run can use ({exc})"
    why = unrealisable(plan, world_size)
    if why:  # the allocator's requirements and this runtime disagree: a bug, not a fallback
        raise RuntimeError(f"the allocator's runnable plan cannot run here: {why}: {describe_plan(plan)}")
    return plan, f"best without the runtime's requirements: {describe_plan(free)}"


class FlowTrainer(Trainer):
    """FlowTrain on this rank (a ViT replica or a GPT stage of :func:`flow_layout`'s layout).
    It always trains the step's packs as they are, so ``parity`` changes nothing here."""

    name = "flowtrain"
    features = ("packing loader", ALLOCATOR_FEATURE, "decoupled schedule over the pool", "varlen attention",
                "Conv->Matmul")

    def __init__(self, cfg: "TrainConfig", env: "DistEnv", *, parity: bool = False) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        from mindspeed_flow.pool import open_pool
        from mindspeed_flow.runtime import Executor
        from mindspeed_flow.train.model import StageModule, build_gpt_stage, init_vision_encoder

        super().__init__(cfg, env, parity=parity)
        if cfg.layout.pool_backend == "local":
            raise ValueError("layout.pool_backend 'local' shares tensors between the threads of one process, but the "
                             "ranks are processes: use 'shm' (one host) or 'torch'")
        chosen = flow_layout(cfg, env.world_size)
        self.decoupled = layout = chosen.decoupled
        self.layout, self.plan_text = chosen.describe(), chosen.plan_text
        if not chosen.from_allocator:
            self.features = tuple("layout from the config (no runnable allocator plan, see plan)"
                                  if f == ALLOCATOR_FEATURE else f for f in self.features)
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=layout.backbone_pp,
                                                 order="tp-cp-ep-pp-dp")
        self.groups = layout.new_groups()
        role = layout.role(env.rank)
        self.region, self.stage = role[0], role[1]
        self.replica = layout.replica(env.rank)
        if self.region == ENCODER_REGION:
            self.model = init_vision_encoder(cfg.model, conv_matmul=True, varlen=True).to(env.device)
            self.role = f"ViT replica {env.rank} (decoupled)"
        else:
            gpt = build_gpt_stage(cfg.model, list(chosen.layer_split), self.stage, packed=True)
            self.model = StageModule(gpt).to(env.device)
            self.role = f"LLM pp{self.stage} dp{self.replica}"
        self.modules = {self.region: self.model}
        self.fused_attn = enable_fused_attn()
        self.pool_name = pool_name(env.rank)
        self.pool = open_pool(cfg.layout.pool_backend, capacity_bytes=pool_bytes(cfg), **self.pool_options())
        ranks = layout.replica_ranks(self.replica)
        self.executor = Executor(ranks.index(env.rank), ranks, group=self.groups["replica"], pool=self.pool)
        self.plans: dict[int, Any] = {}
        dist.barrier()  # every participant's pool is open before the first put
        self.make_optimizer()

    def pool_options(self) -> dict[str, Any]:
        name = f"{self.pool_name}-b{self.replica}"  # one namespace per backbone replica
        if self.cfg.layout.pool_backend == "torch":
            return {"name": name, "group": self.groups["replica"]}
        return {"name": name, "owner": f"rank{self.env.rank}"}

    def forward_backward(self, data: "StepData") -> LocalStep:
        from mindspeed_flow.runtime import Binding
        from mindspeed_flow.train.batches import from_pack
        from mindspeed_flow.train.model import forward_step, loss_rules

        mine = replica_share(len(data.packs), self.replica, self.decoupled.backbone_dp)
        plan = self.plans.get(len(mine))
        if plan is None:
            plan = self.plans[len(mine)] = self.decoupled.plan(len(mine), trainable_encoder=not self.cfg.model.freeze_vit)
        batches = (from_pack(data.packs[i], data.loss_tokens, "varlen").to(self.env.device) for i in mine)
        replicas = self.decoupled.backbone_dp  # average_grads divides by it: undo that
        rules = replace(loss_rules(), grad_scale_func=lambda loss: loss * replicas)
        result = self.executor.run(plan, forward_step, {(self.region, self.stage): Binding(self.model, batches)},
                                   loss=rules)
        executor_intervals(self.stamps, result.timeline)
        loss = sum(float(item["loss"]) for item in result.forward_data_store)
        last = self.region == BACKBONE_REGION and self.stage == self.decoupled.backbone_pp - 1
        first = self.region == BACKBONE_REGION and self.stage == 0
        return LocalStep(loss if last else 0.0,
                         sum(int(data.packs[i]["input_ids"].numel()) for i in mine) if first else 0)

    def reduce_grads(self) -> None:
        with self.stamps.timed(self.region, "REDUCE"):
            self.decoupled.average_grads(self.model, self.groups)

    def close(self) -> None:
        import torch.distributed as dist

        from mindspeed_flow.pool.shm import destroy

        self.pool.close()
        dist.barrier()  # nobody reads the pool any more
        if self.cfg.layout.pool_backend == "shm" and self.env.rank == 0:
            destroy(self.pool_name)
        if self.fused_attn is not None:
            self.fused_attn.remove()
        destroy_model_parallel()


def pool_name(rank: int) -> str:
    """A name no other job or run on this host uses: rank 0's pid and a per-process run
    counter, broadcast (collective)."""
    import torch.distributed as dist

    token = [f"{pool_prefix(os.getpid())}{next(_instances)}" if rank == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return str(token[0])


def pool_prefix(rank0_pid: int) -> str:
    """What every pool name of a job whose rank 0 has this pid starts with: the launcher
    removes what such pools left in /dev/shm once every rank has stopped (a rank killed or
    interrupted never reaches ``close()``)."""
    return f"train{rank0_pid}x"


def pool_bytes(cfg: "TrainConfig") -> int:
    """Each participant's pool segment: ``layout.pool_capacity_mb`` when set, else what one
    rank puts at most: the embeddings (or their gradients) of the microbatches in flight, a
    pack of ``data.capacity`` tokens each, fp32."""
    if cfg.layout.pool_capacity_mb is not None:
        return int(cfg.layout.pool_capacity_mb * 2**20)
    in_flight = (cfg.layout.max_ahead or cfg.data.packs_per_step) + 1
    return max(_POOL_MIN_BYTES, 2 * in_flight * cfg.data.capacity * cfg.model.llm_hidden * 4)
