"""The three-phase co-located baseline: the schedule of MindSpeed-MM's ``--hetero-parallel``
and Megatron MIMO's co-located training, as users run them.

One step, three phases, on the same ranks as the baseline (PP = ``layout.baseline_pp`` x DP):

1. **ViT forward over the whole step**: every rank holds a ViT replica (the encoder is data
   parallel over the world, outside the LLM's pipeline); the step's microbatches (every
   LLM replica's share, in order) are dealt round-robin over the ranks, each encodes its
   own, keeps the autograd graph and sends the embeddings to stage 0 of the LLM replica
   that trains that microbatch;
2. **the LLM's 1F1B on detached embeddings**: megatron-core's own
   ``forward_backward_pipelining_without_interleaving`` (``no_pipelining`` at PP=1), stage 0
   reading each microbatch's embeddings from a leaf tensor (:class:`EmbeddingQueue`), whose
   gradient the backward leaves behind;
3. **ViT backward**: stage 0 sends each leaf's gradient back to the rank that encoded it,
   which runs the ViT's backward from it (skipped with a frozen ViT, ``model.freeze_vit``).

Gradients: the LLM's are summed over its data-parallel replicas (as the baseline), the
ViT's over the whole world (every rank encoded a part of the step), so both are exactly the
step loss's and the run trains the same model as every other run (the job's losses agree).
The switches (:class:`~mindspeed_flow.train.runs.RunFeatures`) are ``baseline-thd``'s by
default (packs, THD / varlen attention, Conv->Matmul), so the two differ by the schedule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mindspeed_flow.flat_grads import all_reduce_flat_grads
from mindspeed_flow.schedule.regions import BACKBONE_REGION, ENCODER_REGION
from mindspeed_flow.train.baseline import BaselineTrainer
from mindspeed_flow.train.runs import THREE_PHASE_FEATURES, RunFeatures
from mindspeed_flow.train.trainer import LocalStep

if TYPE_CHECKING:
    from mindspeed_flow.train.batches import ModelBatch
    from mindspeed_flow.train.config import TrainConfig
    from mindspeed_flow.train.feed import StepData
    from mindspeed_flow.train.launch import DistEnv


class EmbeddingQueue(nn.Module):
    """Stage 0's image embeddings in phase 2: the step's embeddings of this replica's
    microbatches, handed out in microbatch order (Megatron's schedules run the forwards in
    order), as leaf tensors whose ``.grad`` the 1F1B's backward fills."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[torch.Tensor] = []

    def load(self, embeddings: list[torch.Tensor]) -> None:
        self.pending = list(embeddings)

    def forward(self, batch: "ModelBatch") -> torch.Tensor:
        if not self.pending:
            raise RuntimeError(f"three-phase: no encoded embeddings left for samples {batch.sample_ids}")
        return self.pending.pop(0)


class ThreePhaseTrainer(BaselineTrainer):
    """The three-phase co-located run on this rank: a ViT replica, and one pipeline stage of
    one LLM data-parallel replica (see the module docstring)."""

    name = "three-phase"

    def __init__(self, cfg: "TrainConfig", env: "DistEnv", *, parity: bool = False,
                 switches: RunFeatures = THREE_PHASE_FEATURES) -> None:
        import torch.distributed as dist

        if not switches.three_phase:
            raise ValueError(f"ThreePhaseTrainer runs the three-phase schedule: switches {switches} do not ask for it")
        self.queue = EmbeddingQueue()
        self.vit: nn.Module | None = None
        super().__init__(cfg, env, parity=parity, switches=switches)
        places: list[Any] = [None] * env.world_size
        dist.all_gather_object(places, (self.stage, self.replica))
        self.first_rank = {replica: rank for rank, (stage, replica) in enumerate(places) if stage == 0}
        self.trainable_vit = not cfg.model.freeze_vit
        self.embeddings: dict[int, torch.Tensor] = {}  # microbatch -> ViT output (with its graph), on its encoder
        self.leaves: dict[int, torch.Tensor] = {}  # microbatch -> stage 0's detached embeddings

    # ------------------------------------------------------------------ BaselineTrainer's hooks

    def stage_encoder(self) -> nn.Module:
        return self.queue

    def encoder_modules(self) -> dict[str, nn.Module]:
        from mindspeed_flow.train.model import init_vision_encoder

        self.vit = init_vision_encoder(self.cfg.model, conv_matmul=self.switches.conv_matmul,
                                       varlen=self.switches.varlen).to(self.env.device)
        return {"vit": self.vit}

    def role_suffix(self, stage_calls_encoder: bool) -> str:
        return " (ViT replica + LLM)"

    def encoder_place(self) -> str:
        return f"ViT DP={self.env.world_size} on every rank (three-phase)"

    # ------------------------------------------------------------------ the step

    def forward_backward(self, data: "StepData") -> LocalStep:
        work = [(replica, batch) for replica in range(self.replicas) for batch in self.microbatches(data, replica)]
        self._encode(work)
        mine = [j for j, (replica, _) in enumerate(work) if replica == self.replica]
        self.queue.load([self.leaves[j] for j in mine] if self.stage == 0 else [])
        local = super().forward_backward(data)
        if self.trainable_vit:
            self._encoder_backward(work)
        self.embeddings, self.leaves = {}, {}
        return local

    def _encoder_of(self, j: int) -> int:
        return j % self.env.world_size

    def _image_tokens(self, batch: "ModelBatch") -> int:
        return int((batch.input_ids == self.cfg.model.image_token_id).sum())

    def _encode(self, work: list[tuple[int, "ModelBatch"]]) -> None:
        """Phase 1: this rank's microbatches through its ViT replica; the embeddings to
        stage 0 of the replica that trains each (a stage 0 receives those of its replica)."""
        import torch.distributed as dist

        rank, device = self.env.rank, self.env.device
        dtype = next(self.vit.parameters()).dtype
        pending = []
        for j, (replica, batch) in enumerate(work):
            encoder, owner = self._encoder_of(j), self.first_rank[replica]
            if encoder == rank:
                with self.stamps.timed(ENCODER_REGION, "F", j):
                    out = self.vit(batch.to(device))
                self.embeddings[j] = out
                if owner == rank:
                    self.leaves[j] = out.detach()
                elif out.numel():
                    pending.append(dist.isend(out.detach().contiguous(), owner, tag=j))
            elif owner == rank:
                self.leaves[j] = torch.empty(self._image_tokens(batch), self.cfg.model.llm_hidden, dtype=dtype,
                                             device=device)
                if self.leaves[j].numel():
                    pending.append(dist.irecv(self.leaves[j], encoder, tag=j))
        with self.stamps.timed(ENCODER_REGION, "RECV"):
            for request in pending:
                request.wait()
        for leaf in self.leaves.values():
            leaf.requires_grad_(self.trainable_vit)

    def _encoder_backward(self, work: list[tuple[int, "ModelBatch"]]) -> None:
        """Phase 3: each embedding's gradient back to its encoder, then the ViT's backward."""
        import torch.distributed as dist

        rank = self.env.rank
        grads: dict[int, torch.Tensor] = {}
        pending = []
        for j, (replica, _) in enumerate(work):
            encoder, owner = self._encoder_of(j), self.first_rank[replica]
            if owner == rank:
                leaf = self.leaves[j]
                grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                if encoder == rank:
                    grads[j] = grad
                elif grad.numel():
                    pending.append(dist.isend(grad.contiguous(), encoder, tag=j))
            elif encoder == rank and self.embeddings[j].numel():
                grads[j] = torch.empty_like(self.embeddings[j])
                pending.append(dist.irecv(grads[j], owner, tag=j))
        with self.stamps.timed(ENCODER_REGION, "RECV"):
            for request in pending:
                request.wait()
        for j, grad in sorted(grads.items()):
            out = self.embeddings[j]
            if out.numel() and out.requires_grad:
                with self.stamps.timed(ENCODER_REGION, "B", j):
                    torch.autograd.backward(out, grad)

    def reduce_grads(self) -> None:
        with self.stamps.timed(BACKBONE_REGION, "REDUCE"):
            all_reduce_flat_grads([p for p in self.model.parameters() if p.requires_grad], self.dp_group)
        with self.stamps.timed(ENCODER_REGION, "REDUCE"):
            all_reduce_flat_grads([p for p in self.vit.parameters() if p.requires_grad])  # the whole world


__all__ = ["EmbeddingQueue", "ThreePhaseTrainer"]
