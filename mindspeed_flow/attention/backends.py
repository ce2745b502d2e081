"""The varlen attention backends and how one is picked at run time.

The core cannot import ``torch_npu`` or ``flash_attn`` (they exist only on their
devices), so device kernels are registered from ``mindspeed_flow.adapters``
(``adapters/devices/torch_npu.py``, ``adapters/devices/flash_attn.py``) when those are imported; the
fused-attention patches import them.  The portable SDPA backend is registered by the core
itself and serves every device no kernel was registered for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .segments import Window

# fn(q, k, v, offsets_q, offsets_k, causal, scale, window, dropout_p) -> out [Tq, Hq, Dv];
# offsets are normalised ``[0, ..., T]`` lists and the window is already normalised.
BackendFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, list, list, bool, float, Window, float], torch.Tensor
]


@dataclass(frozen=True)
class VarlenBackend:
    """A varlen attention kernel.

    Attributes:
        name: what ``backend=`` selects (``"npu"``, ``"flash_attn"``, ``"sdpa"``).
        device_types: the tensor device types it is the default for; ``("*",)`` is the
            fallback for any device without a dedicated kernel.
        fn: the kernel call, see ``BackendFn``.
        missing: returns why the backend cannot run here (library not installed, ...), or
            ``None`` when it can.  Asked at call time, never at import.
        dtypes: the input dtypes the kernel takes (flash-attn: fp16 and bf16 only), or
            ``None`` for any; other dtypes go to the fallback instead of failing in it.
    """

    name: str
    device_types: tuple[str, ...]
    fn: BackendFn
    missing: Callable[[], Optional[str]] = lambda: None
    dtypes: Optional[tuple[torch.dtype, ...]] = None

    def unusable(self, dtype: Optional[torch.dtype] = None) -> Optional[str]:
        """Why this backend cannot serve inputs of ``dtype`` here, or ``None``."""
        reason = self.missing()
        if reason is None and dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            reason = f"it takes {', '.join(map(str, self.dtypes))} inputs, not {dtype}"
        return reason


_BACKENDS: dict[str, VarlenBackend] = {}


def require_runnable(kernel: str, reason: Optional[str], device: torch.device, device_type: str) -> None:
    """Raise before a device kernel is imported or called: with ``reason`` (its
    ``missing()``) when it cannot run here, or when the tensors are not on its device, so a
    direct call fails with the cause instead of deep inside the kernel."""
    if reason is not None:
        raise RuntimeError(f"{kernel} unavailable: {reason}")
    if device.type != device_type:
        raise RuntimeError(f"{kernel} needs tensors on a {device_type} device, got device {device}")


def register_backend(backend: VarlenBackend) -> None:
    """Add or replace a backend (re-importing an adapter re-registers the same name)."""
    _BACKENDS[backend.name] = backend


def select_backend(
    device_type: str, name: Optional[str] = None, dtype: Optional[torch.dtype] = None
) -> VarlenBackend:
    """The backend for tensors of ``dtype`` on ``device_type``, or the one called ``name``.

    A named backend that cannot run raises with its reason.  Without a name, the first
    registered backend dedicated to the device type that can run is used, else the
    fallback (SDPA per segment); a device kernel that is registered but cannot run (CUDA
    without flash-attn, or fp32 inputs flash-attn does not take) therefore degrades to
    SDPA instead of failing.
    """
    if name is not None:
        if name not in _BACKENDS:
            raise ValueError(
                f"unknown varlen attention backend {name!r}; registered: {sorted(_BACKENDS)} "
                "(device backends register when mindspeed_flow.adapters.devices.torch_npu / .flash_attn are imported)"
            )
        backend = _BACKENDS[name]
        reason = backend.unusable(dtype)
        if reason is not None:
            raise RuntimeError(f"varlen attention backend {name!r} cannot run: {reason}")
        return backend
    for backend in _BACKENDS.values():
        if device_type in backend.device_types and backend.unusable(dtype) is None:
            return backend
    for backend in _BACKENDS.values():
        if "*" in backend.device_types and backend.unusable(dtype) is None:
            return backend
    raise RuntimeError(f"no varlen attention backend can run on device type {device_type!r}")
