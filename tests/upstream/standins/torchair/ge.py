"""Stand-in for ``torchair.ge``: the graph-engine types upstream names in converter
signatures.  Converters are never run on CPU, so the types carry no behaviour."""

import enum

from torch_npu._record import declare


class Tensor:
    """Type of a graph-engine tensor in converter annotations."""


class TensorSpec:
    """Type of a graph-engine tensor spec in converter annotations."""


class DataType(enum.IntEnum):
    """Graph-engine dtypes (names as in torchair)."""

    DT_FLOAT = 0
    DT_FLOAT16 = 1
    DT_INT8 = 2
    DT_INT32 = 3
    DT_UINT8 = 4
    DT_INT16 = 6
    DT_UINT16 = 7
    DT_UINT32 = 8
    DT_INT64 = 9
    DT_UINT64 = 10
    DT_DOUBLE = 11
    DT_BOOL = 12
    DT_BF16 = 27


declare("torchair.ge.Tensor", "torchair.ge.TensorSpec", "torchair.ge.DataType")
