"""Stand-in for ``torch_npu._C._distributed_c10d``: the HCCL process-group class upstream
inspects.  Its ``Options`` has no ``hccl_config``, as in torch_npu builds without it, so
MindSpeed leaves Megatron's process-group options alone (the groups here are gloo)."""

from torch_npu._record import declare


class ProcessGroupHCCL:
    """Never instantiated here: only its ``Options`` class is probed."""

    class Options:
        pass


declare("torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options")
