"""CPU STAND-IN for ``torch_npu`` (Ascend's PyTorch adapter), for the upstream harness only.

Not torch_npu: no NPU exists here.  It exposes an explicit list of symbols (no catch-all
``__getattr__``: MindSpeed probes with ``hasattr`` and would switch on NPU-only branches,
and its patch manager scans ``sys.modules`` per patch), and its kernels are plain-torch
reference implementations of the documented semantics (``_kernels.py``).  The harness
prints ``torch_npu._record.summary()`` so every run shows what was stood in and called.
"""

import torch

from torch_npu import _record
from torch_npu._kernels import npu_fusion_attention, npu_rms_norm, npu_rotary_mul, npu_swiglu
from torch_npu import npu, _C

__version__ = "0.0.0+cpu.standin"
STANDIN = True

# Upstream evaluates torch.device("npu") at import: name the PrivateUse1 backend "npu".
torch.utils.rename_privateuse1_backend("npu")
torch._register_device_module("npu", npu)


class _NoNpuHooks(torch._C._acc.PrivateUse1Hooks):
    """The backend's hooks say no NPU is there, so torch (``dist.barrier`` picking a device,
    for one) keeps to the CPU instead of failing on an unregistered backend."""

    def is_available(self) -> bool:
        return False

    def has_primary_context(self, device_index: int) -> bool:
        return False

    def is_built(self) -> bool:
        return False


_HOOKS = _NoNpuHooks()  # referenced for the life of the process: torch keeps a raw pointer
torch._C._acc.register_python_privateuseone_hook(_HOOKS)


def _tensor_npu(self, device=None, non_blocking=False, **kwargs):
    """``Tensor.npu()``, which torch_npu adds (MindSpeed-MM's dynamic batching calls it):
    the tensor stays where it is, on the CPU."""
    return self


torch.Tensor.npu = _tensor_npu

unsupported_dtype = [torch.float64]
_record.declare("torch_npu.npu", "torch.npu", "torch_npu.unsupported_dtype", "torch_npu.__version__", "Tensor.npu",
                "PrivateUse1 backend \"npu\" (hooks: no NPU)")

__all__ = ["npu", "npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "unsupported_dtype"]
