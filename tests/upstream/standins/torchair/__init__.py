"""CPU STAND-IN for ``torchair`` (Ascend's graph-mode compiler), for the upstream harness only.

Upstream registers graph-mode converters at import; in eager CPU runs they are never used,
so the decorator returns the function unchanged.
"""

from torch_npu._record import declare


def register_fx_node_ge_converter(aten_op):
    """Identity decorator: converters only matter when compiling for the NPU graph engine."""

    def decorate(fn):
        return fn

    return decorate


declare("torchair.register_fx_node_ge_converter")

from torchair import ge  # noqa: E402  (after the decorator: ge imports nothing of ours)
