"""The tests' names for megatron-core's real pipeline schedules on CPU over gloo, on a tiny
GPTModel: the harness itself lives in the package, where the self-test runs it too
(:mod:`mindspeed_flow.adapters.megatron.tiny_gpt`, launched by :mod:`mindspeed_flow.spawn`).

Typical use from a test (``tests/support`` is on ``sys.path`` under pytest)::

    from megatron_cpu_harness import TinyGPTSpec, merge_stage_results, run_pipelined, run_reference

:func:`launch` runs a module-level ``worker(rank, world_size, *args)`` in fresh gloo
processes (:func:`mindspeed_flow.spawn.run_cpu_ranks`); a failing, dying or late rank raises
:class:`HarnessError` with the traceback of the rank that failed first.
"""

from __future__ import annotations

from typing import Any, Callable

from mindspeed_flow.adapters.megatron.global_names import (  # noqa: F401 - the tests' names
    global_name, global_state_dict as full_state_dict, layer_offset, stage_state_dict)
from mindspeed_flow.adapters.megatron.parallel import megatron_parallel  # noqa: F401
from mindspeed_flow.adapters.megatron.tiny_gpt import (  # noqa: F401
    NO_PIPELINING, ONE_F_ONE_B, RANK_NAME, TinyGPTSpec, build_interleaved_chunks, build_stage_model,
    make_microbatches, megatron_virtual_parallel, merge_stage_results, run_pipelined, run_reference, run_schedule)
from mindspeed_flow.spawn import RankFailed as HarnessError  # noqa: F401
from mindspeed_flow.spawn import run_cpu_ranks


def launch(worker: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """``worker(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank."""
    return run_cpu_ranks(worker, world_size, *args, timeout_s=timeout_s, name=RANK_NAME)
