"""Stand-in for ``torch_npu._C`` (the compiled extension): only what upstream reads at start-up."""

from torch_npu._C import _distributed_c10d
