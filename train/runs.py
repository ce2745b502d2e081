"""The runs the main job can train: each is the job's config plus a set of feature switches
(:class:`RunFeatures`), so that two runs differ by exactly the switches that differ and by
nothing else (same samples, same initialisation, same optimizer, same ranks).

- The **ablation chain** turns the plugin's features on one at a time, from the
  MindSpeed-MM-style baseline to FlowTrain: ``baseline`` (padded microbatches, ViT in stage 0,
  Megatron's 1F1B, dense masks, Conv3d) -> ``packing`` (one pack per microbatch, its samples
  kept apart by a dense block-diagonal mask) -> ``varlen`` (varlen attention instead of the
  mask) -> ``conv-matmul`` (the matmul patch embedding) -> ``flowtrain`` (the allocator's
  decoupled layout over the pool).  Each run after the first records the run before it and
  the feature it adds, which is what the report's "bought" column divides by.
- ``baseline-pp<N>[-mbs<M>]`` (``layout.best_baseline_pp``, ``layout.best_baseline_micro_batch_size``):
  the baseline at its best pipeline size and padded micro-batch size.
- ``baseline-thd``: the strongest co-located baseline, Megatron as users can run it at its
  best: packs as microbatches through megatron-core's THD ``packed_seq_params`` (no dense
  mask; the ViT's varlen attention), the matmul patch embedding, the ViT in stage 0 and
  Megatron's own 1F1B (the chain's ``conv-matmul`` switches, named as a baseline), at
  PP=``layout.best_thd_pp`` (its best; ``null``: ``baseline_pp``).
- ``three-phase``: the co-located schedule of MindSpeed-MM's ``--hetero-parallel`` and
  Megatron MIMO: the ViT forward over the whole step's images first (every rank a ViT
  replica), then the LLM's 1F1B on the detached embeddings, then the ViT backward with the
  embeddings' gradients (:mod:`mindspeed_flow.train.three_phase`); ``baseline-thd``'s data
  path, so the two differ by the schedule alone; at PP=``layout.best_three_phase_pp``.
- ``text-only``: the upper bound, the same backbone on the same token sequences without the
  ViT (every image token is embedded as a text token), packed with varlen attention at
  PP=``layout.text_only_pp``.

Only names and plain dataclasses live here (no torch): the command line imports it to list
``--only``'s choices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from mindspeed_flow.train.config import TrainConfig

BASELINE = "baseline"
BASELINE_THD = "baseline-thd"
THREE_PHASE = "three-phase"
FLOWTRAIN = "flowtrain"
TEXT_ONLY = "text-only"


@dataclass(frozen=True)
class RunFeatures:
    """The switches of one run.  All off is the MindSpeed-MM-style baseline.

    ``packing``: each microbatch is one loader pack, its samples kept apart by a dense
    block-diagonal mask (unless ``varlen``) instead of ``micro_batch_size`` samples padded to
    the longest.  ``varlen``: varlen attention over the samples' boundaries (ViT: within each
    image; LLM: megatron-core's THD ``packed_seq_params``), no mask; needs ``packing``.
    ``conv_matmul``: the ViT's patch embedding as a matmul (``PatchEmbedMatmul``) instead of
    Conv3d.  ``decoupled``: the allocator's decoupled layout over the pool (the FlowTrain
    trainer, which runs packing, varlen and Conv->Matmul always, so it needs them on).
    ``text_only``: no ViT; image tokens are embedded as text tokens (the upper bound).
    ``three_phase``: the co-located three-phase schedule (ViT forward over the step, LLM
    1F1B on detached embeddings, ViT backward) instead of the ViT inside stage 0's 1F1B.
    """

    packing: bool = False
    varlen: bool = False
    conv_matmul: bool = False
    decoupled: bool = False
    text_only: bool = False
    three_phase: bool = False

    def __post_init__(self) -> None:
        if self.varlen and not self.packing:
            raise ValueError("RunFeatures: varlen attention takes one packed row per microbatch: turn packing on")
        if self.decoupled and not (self.packing and self.varlen and self.conv_matmul):
            raise ValueError("RunFeatures: the decoupled (FlowTrain) trainer always runs packing, varlen attention "
                             "and Conv->Matmul: turn them on with decoupled")
        if self.decoupled and self.text_only:
            raise ValueError("RunFeatures: a text-only run has no encoder to decouple")
        if self.three_phase and (self.decoupled or self.text_only):
            raise ValueError("RunFeatures: the three-phase schedule runs a co-located ViT: not with decoupled or "
                             "text_only")

    @property
    def kind(self) -> str:
        """The trainer that runs these switches (:func:`~mindspeed_flow.train.trainer.build_trainer`)."""
        return FLOWTRAIN if self.decoupled else THREE_PHASE if self.three_phase else BASELINE


FLOWTRAIN_FEATURES = RunFeatures(packing=True, varlen=True, conv_matmul=True, decoupled=True)
# The co-located baselines at their best data path: packs, THD / varlen attention, Conv->Matmul.
THD_FEATURES = RunFeatures(packing=True, varlen=True, conv_matmul=True)
THREE_PHASE_FEATURES = RunFeatures(packing=True, varlen=True, conv_matmul=True, three_phase=True)


@dataclass(frozen=True)
class ChainStep:
    """One step of the ablation chain: the run's name, the feature it adds in words, and the
    :class:`RunFeatures` switch that turns it on."""

    name: str
    adds: str
    switch: str


ABLATION = (
    ChainStep("packing", "packing (block-diagonal masks)", "packing"),
    ChainStep("varlen", "varlen attention", "varlen"),
    ChainStep("conv-matmul", "Conv->Matmul patch embedding", "conv_matmul"),
    ChainStep(FLOWTRAIN, "the allocator's decoupled layout", "decoupled"),
)
# What ``--only`` can pick (``baseline-pp<N>`` is the configured baseline's, run beside ``baseline``).
RUN_NAMES = (BASELINE, BASELINE_THD, THREE_PHASE, *(s.name for s in ABLATION), TEXT_ONLY)
# The runs of a plain ``mindspeed-flow train``; ``--ablation`` runs every run, ``baseline-pp<N>``
# (when configured) included (docs/train.md: the default job's 3-minute budget on 2 shared cores).
DEFAULT_RUNS = (BASELINE, BASELINE_THD, FLOWTRAIN, TEXT_ONLY)


def is_baseline(name: str) -> bool:
    """Whether the run named ``name`` is a baseline the report gives every run's ratio
    against: ``baseline``, its other configurations (``baseline-pp<N>``, ``baseline-thd``)
    and the three-phase schedule."""
    return name in (BASELINE, THREE_PHASE) or name.startswith(BASELINE + "-")


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved: its name, switches and config; ``previous`` and ``adds``: the run
    before it in the ablation chain and the feature this run adds to it (``None`` outside the
    chain and for its first run)."""

    name: str
    features: RunFeatures
    cfg: "TrainConfig"
    previous: Optional[str] = None
    adds: Optional[str] = None

    @property
    def kind(self) -> str:
        return self.features.kind


def ablation_chain(cfg: "TrainConfig") -> list[RunSpec]:
    """The chain's runs in order, each the previous one's switches with one more on."""
    chain = [RunSpec(BASELINE, RunFeatures(), cfg)]
    for step in ABLATION:
        before = chain[-1]
        chain.append(RunSpec(step.name, dataclasses.replace(before.features, **{step.switch: True}), cfg,
                             previous=before.name, adds=step.adds))
    return chain


def text_only_run(cfg: "TrainConfig") -> RunSpec:
    """The text-only upper bound: packed, varlen, no ViT, at PP=``layout.text_only_pp``."""
    return RunSpec(TEXT_ONLY, RunFeatures(packing=True, varlen=True, text_only=True),
                   cfg.co_located(cfg.layout.text_only_pp))


def catalogue(cfg: "TrainConfig") -> dict[str, RunSpec]:
    """Every run this config can train, by name, in the order the job trains them: the
    baseline, its best configuration (when configured), the THD and three-phase baselines
    (each at its configured best PP), the rest of the chain, text-only."""
    chain = ablation_chain(cfg)
    runs = {chain[0].name: chain[0]}
    best = cfg.best_baseline()
    if best is not None:
        runs[best[0]] = RunSpec(best[0], RunFeatures(), best[1])
    runs[BASELINE_THD] = RunSpec(BASELINE_THD, THD_FEATURES, cfg.thd_config())
    runs[THREE_PHASE] = RunSpec(THREE_PHASE, THREE_PHASE_FEATURES, cfg.three_phase_config())
    runs.update({spec.name: spec for spec in chain[1:]})
    runs[TEXT_ONLY] = text_only_run(cfg)
    return runs


def select(cfg: "TrainConfig", names: tuple[str, ...]) -> list[RunSpec]:
    """The runs named ``names`` (a name this config has no run for is left out), in the
    catalogue's order."""
    return [spec for name, spec in catalogue(cfg).items() if name in names]


__all__ = ["ABLATION", "BASELINE", "BASELINE_THD", "DEFAULT_RUNS", "FLOWTRAIN", "FLOWTRAIN_FEATURES", "RUN_NAMES",
           "TEXT_ONLY", "THD_FEATURES", "THREE_PHASE", "THREE_PHASE_FEATURES", "ChainStep", "RunFeatures", "RunSpec",
           "ablation_chain", "catalogue", "is_baseline", "select", "text_only_run"]
