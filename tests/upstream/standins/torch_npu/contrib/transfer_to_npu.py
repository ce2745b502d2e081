"""Stand-in for ``torch_npu.contrib.transfer_to_npu``: ``torch.cuda.*`` and CUDA devices
redirected, here to the CPU (on Ascend they go to the NPU).  Importing it is the switch."""

import torch

from torch_npu._device import RNG_NAMES, enter_cpu_mode, redirect_module
from torch_npu._record import declare

redirect_module(torch.cuda)
redirect_module(torch.cuda.random, RNG_NAMES)  # Megatron calls torch.cuda.random.get_rng_state
enter_cpu_mode()
declare("torch_npu.contrib.transfer_to_npu")
