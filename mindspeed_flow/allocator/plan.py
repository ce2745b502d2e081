"""A plan: the chosen encoder and backbone configs with what the proxy predicts for them.

Plans are written to YAML/JSON by ``mindspeed-flow plan --out`` and read back by the
``allocator`` patch, which applies them at initialisation.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import AllocatorError
from .files import field_values, read_data, write_data

DECOUPLED = "decoupled"  # the encoder on devices of its own, feeding the backbone through the pool
COLOCATED = "colocated"  # the encoder inside the backbone's pipeline stage 0, same TP and DP
PLACEMENTS = (DECOUPLED, COLOCATED)


@dataclass(frozen=True)
class EncoderConfig:
    """The encoder (producer): ``dp`` replicas of ``tp`` devices each (when co-located:
    the backbone's TP and DP, inside its stage 0)."""

    dp: int
    tp: int
    layers: int

    @property
    def devices(self) -> int:
        return self.dp * self.tp


@dataclass(frozen=True)
class BackboneConfig:
    """The backbone (consumer): ``dp`` pipelines of ``pp`` stages of ``tp`` devices."""

    dp: int
    tp: int
    pp: int
    micro_batch: int
    layer_split: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_split", tuple(int(v) for v in self.layer_split))
        if len(self.layer_split) != self.pp:
            raise AllocatorError(f"backbone: layer_split has {len(self.layer_split)} entries for pp {self.pp}")

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass(frozen=True)
class Prediction:
    """What the proxy predicts for a plan (rates in samples/s, memory in GiB per device)."""

    throughput: float
    production: float
    consumption: float
    mfu: float
    bubble_fraction: float
    backbone_step_s: float
    microbatches: int
    encoder_memory_gib: float
    backbone_memory_gib: float

    @property
    def mismatch(self) -> float:
        return abs(self.production - self.consumption)


@dataclass(frozen=True)
class AllocationPlan:
    """The allocator's answer.

    Attributes:
        encoder, backbone: the two configs.
        global_batch: samples per step the plan was sized for.
        predicted: throughput, rates, MFU, bubble and memory from the proxy.
        alternatives: runner-up plans with other backbone shapes, best first.
        placement: ``"decoupled"`` or ``"colocated"`` (then ``layer_split`` counts the LLM
            layers per stage; stage 0 also holds the whole encoder).
    """

    encoder: EncoderConfig
    backbone: BackboneConfig
    global_batch: int
    predicted: Prediction
    alternatives: tuple["AllocationPlan", ...] = field(default=(), compare=False)
    placement: str = DECOUPLED

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise AllocatorError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")

    @property
    def throughput(self) -> float:
        return self.predicted.throughput

    @property
    def mismatch(self) -> float:
        return self.predicted.mismatch

    @property
    def devices(self) -> int:
        if self.placement == COLOCATED:
            return self.backbone.devices
        return self.encoder.devices + self.backbone.devices

    def to_dict(self, alternatives: bool = True) -> dict[str, Any]:
        data = {"placement": self.placement, "encoder": asdict(self.encoder), "backbone": asdict(self.backbone),
                "global_batch": self.global_batch, "predicted": asdict(self.predicted)}
        data["backbone"]["layer_split"] = list(self.backbone.layer_split)
        if alternatives:
            data["alternatives"] = [a.to_dict(alternatives=False) for a in self.alternatives]
        return data

    def save(self, path: str | Path) -> Path:
        """Write YAML (``.yaml``/``.yml``) or JSON (``.json``), by suffix."""
        return write_data(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan") -> "AllocationPlan":
        if not isinstance(data, Mapping):
            raise AllocatorError(f"{where}: expected a mapping")
        try:
            return cls(
                encoder=EncoderConfig(**field_values(EncoderConfig, data["encoder"], f"{where}: encoder")),
                backbone=BackboneConfig(**field_values(BackboneConfig, data["backbone"], f"{where}: backbone")),
                global_batch=int(data["global_batch"]),
                predicted=Prediction(**field_values(Prediction, data["predicted"], f"{where}: predicted")),
                alternatives=tuple(cls.from_dict(a, f"{where}: alternatives[{i}]")
                                   for i, a in enumerate(data.get("alternatives", ()))),
                placement=data.get("placement", DECOUPLED),
            )
        except KeyError as exc:
            raise AllocatorError(f"{where}: missing key {exc}") from None
        except AllocatorError as exc:
            if str(exc).startswith(where):
                raise
            raise AllocatorError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> "AllocationPlan":
        return cls.from_dict(read_data(path), str(path))
