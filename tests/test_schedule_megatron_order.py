"""Our <1f1b> composition gives the order megatron-core's real 1F1B runs in.

megatron-core's ``forward_backward_pipelining_without_interleaving`` runs on CPU over gloo
(the shared harness); each rank records when its forward and its backward of each
microbatch start.  One launch per pipeline size runs every microbatch count, to keep the
number of (slow) process launches at two.
"""

from __future__ import annotations

import importlib.util

import pytest

from mindspeed_flow.schedule import OneFOneB, Region, compose, validate
from mindspeed_flow.schedule.actions import COMPUTE

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install 'mindspeed-flow[megatron]')",
)

MICROBATCH_COUNTS = (4, 8)


def _record_orders(rank: int, world_size: int, counts: tuple[int, ...]) -> dict[int, list[str]]:
    """Worker: Megatron's 1F1B on this rank's stage, once per microbatch count."""
    from megatron_cpu_harness import (
        ONE_F_ONE_B,
        TinyGPTSpec,
        build_stage_model,
        megatron_parallel,
        run_schedule,
    )

    orders = {}
    with megatron_parallel(pipeline_parallel_size=world_size):
        model = build_stage_model(TinyGPTSpec())
        for count in counts:
            result = run_schedule(model, TinyGPTSpec(num_microbatches=count), ONE_F_ONE_B, record_events=True)
            orders[count] = [f"{e.kind}{e.microbatch}" for e in result.events]
    return orders


def _composed_orders(stages: int, count: int) -> list[list[str]]:
    plan = compose([Region("gpt", 4, OneFOneB(stages=stages))], count)
    validate(plan)
    validate(plan, semantics="rendezvous")
    return [
        [f"{a.kind.value}{a.microbatch}" for a in plan.programs[rank] if a.kind in COMPUTE]
        for rank in range(stages)
    ]


@pytest.mark.parametrize("stages", [2, 4])
def test_1f1b_composition_runs_in_megatrons_order(stages):
    from megatron_cpu_harness import launch

    recorded = launch(_record_orders, stages, MICROBATCH_COUNTS, timeout_s=240)
    for count in MICROBATCH_COUNTS:
        expected = [recorded[rank][count] for rank in range(stages)]
        assert _composed_orders(stages, count) == expected, f"PP={stages}, {count} microbatches"
        assert all(len(order) == 2 * count for order in expected)  # every F and B recorded
