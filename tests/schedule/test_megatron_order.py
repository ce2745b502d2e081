"""Our compositions run in the order megatron-core's real schedules run in.

megatron-core's ``forward_backward_pipelining_without_interleaving`` (and, with PP=2, its
interleaved schedule) run on CPU over gloo through the shared harness; each rank records
when its forward and its backward of each microbatch start.  One launch per pipeline size
runs every microbatch count (and the interleaved case rides in the PP=2 launch), to keep
the number of slow process launches at two.
"""

from __future__ import annotations

import pytest

from mindspeed_flow.schedule import Interleaved1F1B, OneFOneB, Region, compose, validate
from mindspeed_flow.schedule.actions import COMPUTE
from markers import requires_megatron_core

pytestmark = requires_megatron_core

MICROBATCH_COUNTS = (4, 8)
CHUNKS = 2  # model chunks per rank in the interleaved run


def _record_orders(rank: int, world_size: int, counts: tuple[int, ...]) -> dict:
    """Worker: Megatron's 1F1B on this rank's stage once per microbatch count, and with
    PP=2 also its interleaved schedule; returns ``{(schedule, count): [event, ...]}``."""
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
            orders[("1f1b", count)] = [f"{e.kind}{e.microbatch}" for e in result.events]
    if world_size == 2:
        for count in counts:
            orders[("interleaved", count)] = _interleaved_events(world_size, count)
    return orders


def _interleaved_events(world_size: int, count: int) -> list[str]:
    """Megatron's interleaved 1F1B over ``CHUNKS`` one-layer chunks per rank; events are
    ``F<virtual stage>.<microbatch>`` / ``B...``."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving
    from megatron_cpu_harness import TinyGPTSpec, build_interleaved_chunks, make_microbatches, megatron_virtual_parallel

    spec = TinyGPTSpec(num_microbatches=count)
    events: list[str] = []
    with megatron_virtual_parallel(world_size, CHUNKS):
        chunks = build_interleaved_chunks(spec, CHUNKS)
        for chunk, model in enumerate(chunks):
            model.virtual_stage = chunk * world_size + parallel_state.get_pipeline_model_parallel_rank()

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            tag = f"{model.virtual_stage}.{int(batch['index'])}"
            events.append(f"F{tag}")
            output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            output.register_hook(lambda grad: events.append(f"B{tag}"))
            return output, lambda out: (out.float().mean(), {"loss": out.detach().float().mean()})

        forward_backward_pipelining_with_interleaving(
            forward_step_func=forward_step,
            data_iterator=[iter(make_microbatches(spec)) for _ in range(CHUNKS)],
            model=chunks,
            num_microbatches=count,
            seq_length=spec.seq_length,
            micro_batch_size=spec.micro_batch_size,
            forward_only=False,
        )
    return events


def _composed(skeleton, count: int, with_stage: bool) -> list[list[str]]:
    """Per rank compute order of the composition, the same for both blocking semantics."""

    def name(a):
        return f"{a.kind.value}{a.stage}.{a.microbatch}" if with_stage else f"{a.kind.value}{a.microbatch}"

    orders = []
    for semantics in ("eager", "rendezvous"):
        plan = compose([Region("gpt", 4, skeleton)], count, semantics=semantics)
        validate(plan)
        orders.append([[name(a) for a in plan.programs[r] if a.kind in COMPUTE] for r in range(skeleton.stages)])
    assert orders[0] == orders[1]
    return orders[0]


@pytest.mark.parametrize("stages", [2, 4])
def test_compositions_run_in_megatrons_order(stages):
    from megatron_cpu_harness import launch

    recorded = launch(_record_orders, stages, MICROBATCH_COUNTS, timeout_s=240)
    for count in MICROBATCH_COUNTS:
        expected = [recorded[rank][("1f1b", count)] for rank in range(stages)]
        assert all(len(order) == 2 * count for order in expected)  # every F and B recorded
        assert _composed(OneFOneB(stages=stages), count, False) == expected, f"1F1B PP={stages}, M={count}"
        # Megatron's blocking p2p pattern: send after the producer, receive before the
        # consumer is safe for 1F1B even with blocking sends
        validate(compose([Region("gpt", 4, OneFOneB(stages=stages))], count), semantics="rendezvous")
        if stages == 2:
            expected = [recorded[rank][("interleaved", count)] for rank in range(stages)]
            assert all(len(order) == 2 * CHUNKS * count for order in expected)
            composed = _composed(Interleaved1F1B(stages=stages, chunks_per_rank=CHUNKS), count, True)
            assert composed == expected, f"interleaved PP={stages}, chunks={CHUNKS}, M={count}"
