"""The co-located runs, MindSpeed-MM style: the ViT inside pipeline stage 0 of the LLM and
megatron-core's own 1F1B; with every switch off this is the baseline (padded microbatches
under dense masks, Conv3d patch embedding), and the ablation chain's co-located runs turn
the plugin's features on one at a time (:class:`~mindspeed_flow.train.runs.RunFeatures`):
``packing`` (each microbatch one pack, its samples kept apart by a dense block-diagonal
mask), ``varlen`` (varlen attention instead of masks: the ViT's varlen kernel, the LLM's THD
``packed_seq_params`` through the plugin's ``fused_attn`` patch), ``conv_matmul`` (the matmul
patch embedding); ``text_only`` drops the ViT (the text-only upper bound).

Layout: PP = ``layout.baseline_pp`` x DP = ``world_size / PP`` from Megatron's
``initialize_model_parallel``.  Padded: the step's samples, in order, are padded
``data.micro_batch_size`` per microbatch and each data-parallel replica trains an even,
contiguous share of those microbatches; packed (and in parity mode, which turns packing on
with the other switches as they are) each replica trains its share of the packs themselves
(the same microbatches FlowTrain runs).  The schedule is
``forward_backward_pipelining_without_interleaving`` with ``variable_seq_lengths`` (every
microbatch has its own shape) and ``calculate_per_token_loss`` (each microbatch's loss is
already its share of the step loss, Megatron divides by nothing: see
:mod:`mindspeed_flow.train.model`); the replicas' gradients are summed, so they are exactly
those of the step loss.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from mindspeed_flow.adapters.megatron.parallel import destroy_model_parallel
from mindspeed_flow.flat_grads import all_reduce_flat_grads
from mindspeed_flow.schedule.regions import BACKBONE_REGION
from mindspeed_flow.train.runs import RunFeatures
from mindspeed_flow.train.stamps import MegatronStamps
from mindspeed_flow.train.trainer import LocalStep, Trainer, even_split, replica_share

if TYPE_CHECKING:
    import torch

    from mindspeed_flow.train.config import TrainConfig
    from mindspeed_flow.train.feed import StepData
    from mindspeed_flow.train.launch import DistEnv


def colocated_features(pp: int, switches: RunFeatures) -> tuple[str, ...]:
    """What a co-located run does, in the report's words."""
    return ("no pipeline (megatron-core)" if pp == 1 else "1F1B (megatron-core)",
            "no ViT (text only)" if switches.text_only else
            "three-phase: ViT forward over the step on every rank, LLM on detached embeddings, ViT backward"
            if switches.three_phase else "ViT in stage 0",
            "packs as microbatches" if switches.packing else "padded microbatches",
            "varlen attention" if switches.varlen else
            "dense block-diagonal masks" if switches.packing else "dense masks",
            *(() if switches.text_only else ("Conv->Matmul" if switches.conv_matmul else "Conv3d",)))


class BaselineTrainer(Trainer):
    """A co-located run on this rank: one pipeline stage of one data-parallel replica (stage
    0 holds the ViT too, unless text only), with ``switches`` (all off: the baseline)."""

    name = "baseline"

    def __init__(self, cfg: "TrainConfig", env: "DistEnv", *, parity: bool = False,
                 switches: RunFeatures = RunFeatures()) -> None:
        from megatron.core import parallel_state

        from mindspeed_flow.train.model import StageModule, build_gpt_stage, enable_fused_attn

        if switches.decoupled:
            raise ValueError("BaselineTrainer runs co-located layouts: a decoupled run is FlowTrainer's")
        super().__init__(cfg, env, parity=parity)
        self.switches = dataclasses.replace(switches, packing=switches.packing or parity)
        pp = cfg.layout.baseline_pp
        if env.world_size % pp:
            raise ValueError(f"layout.baseline_pp={pp} does not divide the world of {env.world_size} ranks")
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.replica = parallel_state.get_data_parallel_rank()
        self.replicas = parallel_state.get_data_parallel_world_size()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.last_stage = self.stage == pp - 1
        layers = even_split(cfg.model.llm_layers, pp)
        varlen, text_only = self.switches.varlen, self.switches.text_only
        self.fused_attn = enable_fused_attn() if varlen else None
        gpt = build_gpt_stage(cfg.model, layers, self.stage, packed=varlen)
        self.stamps = MegatronStamps(env.rank, env.device)
        self.stamps.install()
        vit = self.stage_encoder() if self.stage == 0 and not text_only else None
        self.model = StageModule(gpt, vit=vit, text_only=text_only).to(env.device)
        self.modules = {"stage": self.model, **self.encoder_modules()}
        self.role = f"pp{self.stage} dp{self.replica}" + self.role_suffix(vit is not None)
        self.layout = f"PP={pp} x DP={self.replicas}, {self.encoder_place()}, LLM layers {layers}"
        self.features = colocated_features(pp, self.switches)
        self.make_optimizer()

    # ------------------------------------------------------------------ where the ViT runs (overridden
    # by the three-phase run, whose ViT is a replica on every rank outside the pipeline)

    def stage_encoder(self) -> "torch.nn.Module":
        """What stage 0's :class:`StageModule` calls for the image embeddings: the ViT itself,
        inside the stage (timed as region ``vit`` within the stage's forward and backward)."""
        from mindspeed_flow.train.model import init_vision_encoder

        vit = init_vision_encoder(self.cfg.model, conv_matmul=self.switches.conv_matmul, varlen=self.switches.varlen)
        self.stamps.watch_encoder(vit)
        return vit

    def encoder_modules(self) -> dict[str, "torch.nn.Module"]:
        """Modules this rank trains besides its stage (none: the ViT is inside stage 0)."""
        return {}

    def role_suffix(self, stage_calls_encoder: bool) -> str:
        return " (ViT + LLM)" if stage_calls_encoder else " (LLM)"

    def encoder_place(self) -> str:
        return "no ViT (text only)" if self.switches.text_only else "ViT in stage 0"

    def microbatches(self, data: "StepData", replica: "int | None" = None) -> list:
        """Data-parallel replica ``replica``'s microbatches of the step (default: this rank's)."""
        from mindspeed_flow.train.batches import from_pack, padded_microbatches

        replica = self.replica if replica is None else replica
        if self.switches.packing:
            mine = replica_share(len(data.packs), replica, self.replicas)
            attention = "varlen" if self.switches.varlen else "dense"
            return [from_pack(data.packs[i], data.loss_tokens, attention) for i in mine]
        # MindSpeed-MM's data parallelism: the step's samples in order, micro_batch_size per
        # microbatch, an even share of the microbatches per replica.
        padded = padded_microbatches(data.packs, self.cfg.data.micro_batch_size, data.loss_tokens,
                                     image_token_id=self.cfg.model.image_token_id)
        return [padded[i] for i in replica_share(len(padded), replica, self.replicas)]

    def forward_backward(self, data: "StepData") -> LocalStep:
        from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

        from mindspeed_flow.train.model import forward_step

        batches = [b.to(self.env.device) for b in self.microbatches(data)]
        count = len(batches)
        store = get_forward_backward_func()(
            forward_step_func=self.stamps.forward_step(forward_step), data_iterator=iter(batches),
            model=self.model, num_microbatches=count,
            seq_length=max(b.input_ids.shape[1] for b in batches),
            micro_batch_size=max(b.input_ids.shape[0] for b in batches), forward_only=False)
        loss = sum(float(item["loss"]) for item in store) if self.last_stage else 0.0
        padded = sum(b.padded_tokens for b in batches) if self.stage == 0 else 0
        return LocalStep(loss, padded)

    def reduce_grads(self) -> None:
        with self.stamps.timed(BACKBONE_REGION, "REDUCE"):
            all_reduce_flat_grads(self.parameters(), self.dp_group)

    def close(self) -> None:
        self.stamps.remove()
        if self.fused_attn is not None:
            self.fused_attn.remove()
        destroy_model_parallel()

