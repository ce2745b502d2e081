"""System tuning (feature ``system``): NUMA-aware core binding per local rank and the
Ascend environment defaults, both applied when the plugin activates, before ``torch_npu``
is imported.  Neither changes a number a run computes."""
