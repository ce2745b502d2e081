"""megatron-core 0.12's ``torch_dist`` checkpoint writer on this machine's torch (2.13).

Megatron 0.12 calls torch's private ``_write_item`` without the ``serialization_format``
argument that later torch versions require (the pinned cluster stack, torch 2.7, has no
such argument).  :func:`bind_serialization_format` binds torch's default format, so the
writer's forked workers can save; the bytes written are torch's ordinary format.  Used by
the tests that save real distributed checkpoints, with the pip wheel and with the Megatron
copy inside the pinned MindSpeed-MM tree alike.
"""

from __future__ import annotations

import functools


def bind_serialization_format() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint import filesystem

    if "serialization_format" in filesystem._write_item.__code__.co_varnames:
        filesystem_async._write_item = functools.partial(
            filesystem._write_item, serialization_format=filesystem.SerializationFormat.TORCH_SAVE
        )
