"""What the allocator plans for: the model's two modules, the cluster, the workload.

Every spec is a frozen dataclass; :func:`load_config` reads all three from one YAML file
(``configs/allocator/*.yaml``) and names the file and key of anything missing or wrong.
FLOP and parameter counts are derived from the shapes here so that profiles measured on a
tiny model transfer to a large one by their work per rank (see :mod:`.proxy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..typed_yaml import build
from .errors import AllocatorError
from .files import read_data

GIB = 2**30


@dataclass(frozen=True)
class ModuleSpec:
    """One transformer module (the vision encoder or the LLM backbone).

    Attributes:
        layers, hidden, heads, ffn: the transformer's shape.
        query_groups: key/value heads (GQA); defaults to ``heads``.
        tokens_per_sample: tokens one training sample brings to this module (image patches
            for the encoder, the packed sequence for the backbone).
        attention_span: tokens each token attends to (a window); defaults to
            ``tokens_per_sample``.
        vocab: vocabulary of the LM head and embedding (0 for an encoder).
        gated: SwiGLU MLP (three matrices) rather than two.
        trainable: has a backward pass and optimizer state.
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    tokens_per_sample: int
    query_groups: int = 0
    attention_span: int = 0
    vocab: int = 0
    gated: bool = True
    trainable: bool = True

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "ffn", "tokens_per_sample"):
            if getattr(self, name) < 1:
                raise AllocatorError(f"module spec: {name} must be >= 1, got {getattr(self, name)}")
        if not self.query_groups:
            object.__setattr__(self, "query_groups", self.heads)
        if not self.attention_span:
            object.__setattr__(self, "attention_span", self.tokens_per_sample)

    @property
    def layer_params(self) -> int:
        """Weights of one layer: QKV and output projections plus the MLP."""
        kv = 2 * self.hidden * self.query_groups // self.heads
        attention = self.hidden * (self.hidden + kv) + self.hidden * self.hidden
        return attention + (3 if self.gated else 2) * self.hidden * self.ffn

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden

    def layer_forward_flops(self, samples: int) -> float:
        """Forward FLOPs of one layer for ``samples`` samples: GEMMs plus attention."""
        tokens = samples * self.tokens_per_sample
        return 2.0 * self.layer_params * tokens + 4.0 * tokens * self.attention_span * self.hidden

    def head_forward_flops(self, samples: int) -> float:
        """Forward FLOPs of the LM head (0 without a vocabulary)."""
        return 2.0 * samples * self.tokens_per_sample * self.hidden * self.vocab

    def forward_flops(self, samples: int) -> float:
        return self.layers * self.layer_forward_flops(samples) + self.head_forward_flops(samples)


@dataclass(frozen=True)
class ModelSpec:
    """A VLM: the encoder produces what the backbone consumes, one sample at a time."""

    encoder: ModuleSpec
    backbone: ModuleSpec
    name: str = "model"


@dataclass(frozen=True)
class ClusterSpec:
    """The devices a job may use.

    Attributes:
        devices: the device budget.
        devices_per_node: a TP group must fit inside one node (and tile it).
        memory_gib: memory per device; ``memory_reserve`` of it is kept for the runtime.
        peak_tflops: dense bf16 peak per device (MFU is measured against it).
        intra_node_gbps, inter_node_gbps: GB/s per device inside a node / between nodes.
        latency_us: per-message latency of a transfer.
    """

    devices: int
    devices_per_node: int = 8
    memory_gib: float = 64.0
    memory_reserve: float = 0.1
    peak_tflops: float = 300.0
    intra_node_gbps: float = 150.0
    inter_node_gbps: float = 25.0
    latency_us: float = 20.0
    name: str = "cluster"

    def __post_init__(self) -> None:
        if self.devices < 1 or self.devices_per_node < 1:
            raise AllocatorError(f"cluster: devices ({self.devices}) and devices_per_node "
                                 f"({self.devices_per_node}) must be >= 1")
        if not 0 <= self.memory_reserve < 1:
            raise AllocatorError(f"cluster: memory_reserve must be in [0, 1), got {self.memory_reserve}")

    @property
    def memory_limit(self) -> float:
        """Bytes per device a plan may use."""
        return self.memory_gib * GIB * (1 - self.memory_reserve)


@dataclass(frozen=True)
class Workload:
    """How the job trains, and which parallel sizes the search may use.

    Attributes:
        global_batch: samples per optimizer step (Megatron's ``--global-batch-size``).
        tp_choices: tensor-parallel sizes to consider for both modules.
        pp_choices: pipeline sizes for the backbone (``()``: every divisor of its layers).
        micro_batch_choices: backbone micro batch sizes, in samples.
        encoder_micro_batch: samples per encoder microbatch.
        encoder_in_flight: encoder microbatches whose activations one producer holds until
            their backward (FlowTrain's bounded pool).
        distributed_optimizer: optimizer state sharded over DP (Megatron's
            ``--use-distributed-optimizer``).
        alternatives: how many runner-up plans to report.
        placements: where the encoder may go: ``"decoupled"`` (devices of its own) and/or
            ``"colocated"`` (inside the backbone's stage 0, Megatron-style).
        megatron_blocks: a decoupled plan must run in one Megatron world, whose
            ``initialize_model_parallel`` cuts every rank into backbone ``tp x pp`` blocks:
            the encoder's devices (``dp x tp``) a multiple of the backbone's ``tp x pp``,
            and its replicas a multiple of the backbone's (each backbone replica is fed by
            as many encoder replicas: FlowTrain's ``DecoupledLayout``).  Off by default.
        encoder_split: a decoupled plan's encoder replicas split evenly over its backbone
            replicas (each backbone replica fed by encoder replicas of its own), what a
            ``DecoupledLayout`` runs, without ``megatron_blocks``' block rule: MindSpeed-MM's
            job under the ``pool`` feature builds each role's Megatron groups on its own ranks.
            Implied by ``megatron_blocks``.  Off by default.
        exact_devices: use every device of the budget (a runtime whose world is fixed),
            not at most the budget.  Off by default.
    """

    global_batch: int
    tp_choices: tuple[int, ...] = (1, 2, 4, 8)
    pp_choices: tuple[int, ...] = ()
    micro_batch_choices: tuple[int, ...] = (1, 2)
    encoder_micro_batch: int = 1
    encoder_in_flight: int = 4
    distributed_optimizer: bool = True
    alternatives: int = 3
    placements: tuple[str, ...] = ("decoupled", "colocated")
    megatron_blocks: bool = False
    encoder_split: bool = False
    exact_devices: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "placements", tuple(self.placements))
        unknown = set(self.placements) - {"decoupled", "colocated"}
        if unknown or not self.placements:
            raise AllocatorError(f"workload: placements must be among decoupled, colocated; got {self.placements}")
        for name in ("tp_choices", "pp_choices", "micro_batch_choices"):
            values = tuple(int(v) for v in getattr(self, name))
            if any(v < 1 for v in values):
                raise AllocatorError(f"workload: {name} must hold sizes >= 1, got {values}")
            object.__setattr__(self, name, values)
        if self.global_batch < 1 or self.encoder_micro_batch < 1 or self.encoder_in_flight < 1:
            raise AllocatorError("workload: global_batch, encoder_micro_batch and encoder_in_flight must be >= 1")


def _build(cls: type, data: Any, path: Path, where: str) -> Any:
    return build(cls, data, path=path, where=where, error=AllocatorError)


@dataclass(frozen=True)
class AllocatorConfig:
    """One planning problem as read from a YAML file."""

    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload
    profile: Path


def load_config(path: str | Path) -> AllocatorConfig:
    """Read ``model`` (``encoder``, ``backbone``), ``cluster``, ``workload`` and ``profile``
    (a path relative to the file) from a YAML file."""
    path = Path(path)
    data = read_data(path)
    if not isinstance(data, Mapping):
        raise AllocatorError(f"{path}: expected a mapping at the top level")
    for key in ("model", "cluster", "workload", "profile"):
        if key not in data:
            raise AllocatorError(f"{path}: missing key {key!r}")
    model = data["model"]
    if not isinstance(model, Mapping) or "encoder" not in model or "backbone" not in model:
        raise AllocatorError(f"{path}: model needs 'encoder' and 'backbone'")
    return AllocatorConfig(
        model=ModelSpec(
            encoder=_build(ModuleSpec, model["encoder"], path, "model.encoder"),
            backbone=_build(ModuleSpec, model["backbone"], path, "model.backbone"),
            name=str(model.get("name", path.stem)),
        ),
        cluster=_build(ClusterSpec, data["cluster"], path, "cluster"),
        workload=_build(Workload, data["workload"], path, "workload"),
        profile=(path.parent / data["profile"]).resolve(),
    )
