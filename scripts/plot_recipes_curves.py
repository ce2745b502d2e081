"""Loss curves of a tiny VLM on CPU with and without the ``recipes`` feature's per-module
learning rates and per-module gradient clipping; writes ``docs/recipes_loss.png``.

The model has MindSpeed-MM's module names (``image_encoder.encoder``,
``image_encoder.projector``, ``text_decoder``); the optimizer's groups come from
megatron-core's own ``_get_param_groups`` and the LR from its ``OptimizerParamScheduler``
(warm-up + cosine), patched through the plugin's registry exactly as in a job.  The task:
predict a token from an image's patches (through encoder and projector) and the previous
token (text decoder), with a noisy vision input that makes the encoder's gradient spiky.
The baseline is the same run with the feature off (global clip only).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from mindspeed_flow.adapters.megatron import recipes as megatron_core_recipes
from mindspeed_flow.patches import recipes as recipes_patches
from mindspeed_flow.patching import PatchRegistry
from mindspeed_flow.recipes.module_clip import clip_grads_per_module

VOCAB, PATCH, HIDDEN, PATCHES = 32, 24, 64, 8
CONFIGS = {
    "baseline (global clip 1.0)": {},
    "per-module LR (encoder x0.2, projector x2 warm-up 50)": {
        "flow_module_lr": ["image_encoder.encoder=0.2", "image_encoder.projector=2"],
        "flow_module_lr_warmup": ["image_encoder.projector=50"]},
    "per-module grad clip (encoder 0.1, projector 0.3, decoder 0.5)": {
        "flow_module_grad_clip": ["image_encoder.encoder=0.1", "image_encoder.projector=0.3", "text_decoder=0.5"]},
}


class TinyVLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from megatron.core.distributed import DistributedDataParallelConfig
        self.ddp_config = DistributedDataParallelConfig()
        self.image_encoder = nn.Module()
        self.image_encoder.encoder = nn.Sequential(nn.Linear(PATCH, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN))
        self.image_encoder.projector = nn.Sequential(nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN))
        self.text_decoder = nn.ModuleDict({"embed": nn.Embedding(VOCAB, HIDDEN),
                                           "mlp": nn.Sequential(nn.Linear(2 * HIDDEN, HIDDEN), nn.GELU()),
                                           "head": nn.Linear(HIDDEN, VOCAB)})

    def forward(self, patches: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        image = self.image_encoder.projector(self.image_encoder.encoder(patches).mean(1))
        text = self.text_decoder["embed"](prev)
        return self.text_decoder["head"](self.text_decoder["mlp"](torch.cat([image, text], -1)))


def batches(steps: int, batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    codebook = torch.randn(VOCAB, PATCH, generator=gen)
    for step in range(steps):
        target = torch.randint(0, VOCAB, (batch,), generator=gen)
        prev = (target + torch.randint(0, 3, (batch,), generator=gen)) % VOCAB
        noise = 0.5 + (4.0 if step % 25 == 0 else 0.0)  # periodic vision spikes
        patches = codebook[target][:, None] + noise * torch.randn(batch, PATCHES, PATCH, generator=gen)
        yield patches, prev, target


def train(flags: dict, steps: int, seed: int) -> list[float]:
    import megatron.core.optimizer as opt_module
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    registry = PatchRegistry(recipes_patches.PATCHES)
    ns = argparse.Namespace(**{d: flags.get(d) for d in
                               ("flow_module_lr", "flow_module_lr_warmup", "flow_module_grad_clip")})
    megatron_core_recipes.configure(ns)
    max_norms = megatron_core_recipes.current_clip()
    if flags:
        registry.enable({"recipes"})
    try:
        torch.manual_seed(seed)
        model = TinyVLM()
        groups = opt_module._get_param_groups([model], None, None, 1.0, 3e-3, 1e-4, None, None)
        optimizer = torch.optim.AdamW(groups, lr=3e-3)
        sched = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=3e-3, min_lr=1e-4, lr_warmup_steps=20,
                                        lr_decay_steps=steps, lr_decay_style="cosine", start_wd=0.01,
                                        end_wd=0.01, wd_incr_steps=steps, wd_incr_style="constant")
        losses = []
        for patches, prev, target in batches(steps, 32, seed):
            loss = nn.functional.cross_entropy(model(patches, prev), target)
            optimizer.zero_grad()
            loss.backward()
            if max_norms:
                clip_grads_per_module(model.named_parameters(), max_norms)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            sched.step(1)
            losses.append(float(loss))
        return losses
    finally:
        registry.remove()
        megatron_core_recipes.reset()


def smooth(values: list[float], k: int = 10) -> list[float]:
    return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("docs/recipes_loss.png"))
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, flags in tqdm(CONFIGS.items(), desc="configs"):
        runs = [train(flags, args.steps, seed) for seed in range(args.seeds)]
        mean = [sum(r[i] for r in runs) / len(runs) for i in range(args.steps)]
        last = sum(mean[-50:]) / 50
        print(f"{name}: mean loss over the last 50 steps {last:.4f} ({args.seeds} seeds)")
        ax.plot(smooth(mean), label=f"{name}: {last:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean of {args.seeds} seeds, 10-step average)")
    ax.set_title("tiny VLM on CPU: recipes vs baseline")
    ax.legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
