"""Megatron's model-parallel state, set up and torn down completely.

``parallel_state.destroy_model_parallel`` (megatron-core 0.12 and 0.16) leaves the
embedding group-rank lists behind, and the next initialisation sets them only on the groups'
members: a rank left out (rank 1 of a PP=2 run after a PP=1 one in the same process) would
still believe it is in the group.  :func:`destroy_model_parallel` clears them too; every
teardown of the project (the main job's runs, the CPU harness, the self-test) goes through it.

megatron-core is imported inside the functions only.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

_LEFT_BEHIND = ("_EMBEDDING_GLOBAL_RANKS", "_POSITION_EMBEDDING_GLOBAL_RANKS")


def destroy_model_parallel() -> None:
    """``parallel_state.destroy_model_parallel()`` plus the group-rank lists it leaves behind."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    for leaked in _LEFT_BEHIND:
        if hasattr(parallel_state, leaked):
            setattr(parallel_state, leaked, None)


@contextmanager
def megatron_parallel(pipeline_parallel_size: int = 1, *, cpu_shims: bool = True, **kwargs: Any) -> Iterator[None]:
    """Megatron's model-parallel state for the body (the given PP, ``kwargs`` passed on to
    ``initialize_model_parallel``, DP the rest), with megatron-core's CPU shims when
    ``cpu_shims`` (:func:`~mindspeed_flow.adapters.megatron.core.enable_cpu_shims`); all of it
    undone on exit, so one process can run several configurations."""
    from megatron.core import parallel_state

    from .core import enable_cpu_shims

    shims = enable_cpu_shims() if cpu_shims else None
    try:
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pipeline_parallel_size, **kwargs)
        try:
            yield
        finally:
            destroy_model_parallel()
    finally:
        if shims is not None:
            shims.remove()
