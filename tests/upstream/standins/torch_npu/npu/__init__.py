"""Stand-in for ``torch_npu.npu`` (also installed as ``torch.npu``): the CPU as the device."""

from torch_npu._device import CPU_MEANINGS, redirect_module
import sys as _sys

redirect_module(_sys.modules[__name__])
device = CPU_MEANINGS["device"]
