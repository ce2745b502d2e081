"""Where the allocator's profiler runs: the CPU (gloo), a CUDA GPU (nccl) or an Ascend NPU
(hccl through torch_npu), chosen at run time.

Only the CPU path has been run (this project's machines have no GPU or NPU); the CUDA and
NPU paths are written against the documented APIs (``torch.cuda.Event(enable_timing=True)``
/ ``torch.npu.Event``, ``synchronize``, ``set_device``, the ``nccl`` / ``hccl`` process
group backends) and fail early, with a message naming what is missing, where the
requested device is not there.
"""

from __future__ import annotations

import importlib
import importlib.util
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mindspeed_flow.adapters.errors import DeviceUnavailableError

DEVICES = ("auto", "cpu", "cuda", "npu")


@dataclass(frozen=True)
class ProfileDevice:
    """One profiling backend.

    Attributes:
        kind: ``"cpu"``, ``"cuda"`` or ``"npu"``.
        dist_backend: the torch.distributed backend TP ranks join (gloo, nccl, hccl).
    """

    kind: str
    dist_backend: str

    @property
    def accelerator(self) -> Any:
        """``torch.cuda`` or ``torch.npu`` (registered by torch_npu); None on the CPU."""
        return None if self.kind == "cpu" else getattr(torch, self.kind)

    def torch_device(self, rank: int) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, rank)

    def bind(self, rank: int) -> None:
        """Make ``rank``'s device the current one (before the process group is created).
        On an NPU, torch_npu's ``transfer_to_npu`` also maps megatron-core's ``torch.cuda``
        calls to the NPU."""
        if self.kind == "npu":
            importlib.import_module("torch_npu.contrib.transfer_to_npu")
        if self.accelerator is not None:
            self.accelerator.set_device(rank)

    def timed(self, work: Callable[[], Any]) -> tuple[Any, float]:
        """``work()``'s result and its seconds: wall clock on the CPU, device events
        bracketing the work (then synchronised) on an accelerator, so queued kernels count."""
        if self.accelerator is None:
            start = time.perf_counter()
            result = work()
            return result, time.perf_counter() - start
        begin, end = (self.accelerator.Event(enable_timing=True) for _ in range(2))
        begin.record()
        result = work()
        end.record()
        self.accelerator.synchronize()
        return result, begin.elapsed_time(end) / 1e3

    def name(self) -> str:
        """What a profile records as its device."""
        if self.accelerator is None:
            import platform

            return f"cpu: {platform.processor() or platform.machine()}, 1 thread per rank"
        return f"{self.kind}: {self.accelerator.get_device_name(0)}"


def _npu_module() -> Any:
    """torch_npu imported (it registers ``torch.npu``), or a clear error."""
    try:
        return importlib.import_module("torch_npu")
    except ImportError as exc:
        raise DeviceUnavailableError(f"device 'npu' requested but torch_npu cannot be imported ({exc}); "
                                     "install Ascend's torch_npu matching this torch, or profile the CPU with "
                                     "--device cpu") from None


def _require_count(kind: str, available: bool, count: int, ranks: int) -> None:
    if not available:
        raise DeviceUnavailableError(f"device {kind!r} requested but torch.{kind}.is_available() is False: "
                                     f"no {kind.upper()} device on this machine (profile the CPU with --device cpu)")
    if count < ranks:
        raise DeviceUnavailableError(f"device {kind!r}: TP {ranks} needs {ranks} devices, found {count}")


def select_device(device: str, ranks: int) -> ProfileDevice:
    """The backend for ``device`` (one of :data:`DEVICES`) with ``ranks`` TP ranks on one
    node. ``auto`` takes CUDA where it is available, else an NPU where torch_npu imports and
    reports one, else the CPU."""
    if device not in DEVICES:
        raise ValueError(f"profiling device must be one of {DEVICES}, got {device!r}")
    if device == "auto":
        if torch.cuda.is_available():
            device = "cuda"
        elif importlib.util.find_spec("torch_npu") is not None and _npu_module() and torch.npu.is_available():
            device = "npu"
        else:
            device = "cpu"
    if device == "cuda":
        _require_count("cuda", torch.cuda.is_available(), torch.cuda.device_count(), ranks)
        return ProfileDevice("cuda", "nccl")
    if device == "npu":
        _npu_module()
        _require_count("npu", torch.npu.is_available(), torch.npu.device_count(), ranks)
        return ProfileDevice("npu", "hccl")
    if torch.cuda.is_available():
        raise DeviceUnavailableError("device 'cpu' requested on a CUDA machine: megatron-core's CPU shims "
                                     "refuse to run there; use device 'cuda' (or 'auto')")
    return ProfileDevice("cpu", "gloo")
