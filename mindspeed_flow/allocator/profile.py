"""Measured throughput points, stored as YAML or JSON files.

A :class:`Profile` holds forward and backward wall times of a module block measured at a
few (module, tp, micro batch, sequence) points on one kind of device, together with the
FLOPs each point did and the device's measured peak.  The proxy reads efficiency
(achieved / peak) off these points as a function of the work per rank, which is what lets
a profile of a tiny model on this machine size a large one (see :mod:`.proxy`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import AllocatorError
from .files import field_values, read_data, write_data

MODULES = ("encoder", "backbone")


@dataclass(frozen=True)
class ProfilePoint:
    """One measurement: a block of ``layers`` layers on a TP group of ``tp`` ranks.

    Attributes:
        module: ``"encoder"`` or ``"backbone"``.
        tp, micro_batch, seq: where it was measured (samples per microbatch, tokens per sample).
        layers: layers in the measured block.
        forward_s, backward_s: median wall seconds of one forward / one backward of the block.
        flops: forward FLOPs of the block per TP rank (the backward does twice as many).
        hidden: the block's hidden size (0: not recorded); TP > 1 points need it, to
            separate their all-reduce time from compute (:mod:`.tp_calibration`).
    """

    module: str
    tp: int
    micro_batch: int
    seq: int
    layers: int
    forward_s: float
    backward_s: float
    flops: float
    hidden: int = 0

    def __post_init__(self) -> None:
        if self.module not in MODULES:
            raise AllocatorError(f"module must be one of {MODULES}, got {self.module!r}")
        for name in ("tp", "micro_batch", "seq", "layers"):
            if int(getattr(self, name)) < 1:
                raise AllocatorError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("forward_s", "backward_s", "flops"):
            if not float(getattr(self, name)) > 0:
                raise AllocatorError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def achieved_flops(self) -> float:
        """FLOP/s per rank over forward plus backward."""
        return 3.0 * self.flops / (self.forward_s + self.backward_s)


@dataclass(frozen=True)
class Profile:
    """Points measured on one device kind.

    Attributes:
        device: what was measured on (``"cpu: <model name>, torch 2.13"``).
        peak_tflops: the device's measured dense-GEMM peak; efficiency is achieved / this.
        points: the measurements.
        source: how they were taken (script, date, megatron-core version).
        tp_link_gbps, tp_link_latency_us: the link TP ran over while profiling (GB/s, us);
            needed when there are TP > 1 points (0: not given).
    """

    device: str
    peak_tflops: float
    points: tuple[ProfilePoint, ...]
    source: str = ""
    tp_link_gbps: float = 0.0
    tp_link_latency_us: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "points", tuple(self.points))
        if not self.peak_tflops > 0:
            raise AllocatorError(f"profile: peak_tflops must be > 0, got {self.peak_tflops}")
        if any(p.tp > 1 for p in self.points) and not self.tp_link_gbps > 0:
            raise AllocatorError(f"profile ({self.device}): has tp > 1 points but no tp_link_gbps "
                                 "(the link TP ran over while profiling)")

    def module_points(self, module: str, tp: int | None = None) -> list[ProfilePoint]:
        return [p for p in self.points if p.module == module and (tp is None or p.tp == tp)]

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "peak_tflops": self.peak_tflops, "source": self.source,
                "tp_link_gbps": self.tp_link_gbps, "tp_link_latency_us": self.tp_link_latency_us,
                "points": [asdict(p) for p in self.points]}

    def save(self, path: str | Path) -> Path:
        """Write YAML (``.yaml``/``.yml``) or JSON (``.json``), by suffix."""
        return write_data(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read a profile file; a bad point is named by its index."""
        return cls.from_dict(read_data(path), str(path))

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> "Profile":
        if not isinstance(data, Mapping):
            raise AllocatorError(f"{where}: expected a mapping")
        for key in ("device", "peak_tflops", "points"):
            if key not in data:
                raise AllocatorError(f"{where}: missing key {key!r}")
        return cls(device=str(data["device"]), peak_tflops=float(data["peak_tflops"]),
                   points=tuple(_point(p, f"{where}: points[{i}]") for i, p in enumerate(data["points"])),
                   source=str(data.get("source", "")), tp_link_gbps=float(data.get("tp_link_gbps", 0.0)),
                   tp_link_latency_us=float(data.get("tp_link_latency_us", 0.0)))


def _point(data: Any, where: str) -> ProfilePoint:
    try:
        return ProfilePoint(**field_values(ProfilePoint, data, where))
    except AllocatorError as exc:
        if str(exc).startswith(where):
            raise
        raise AllocatorError(f"{where}: {exc}") from None
