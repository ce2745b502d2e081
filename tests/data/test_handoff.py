"""Issue 19, defect 1: the packing loader at PP >= 2, under megatron-core's real schedules.

MindSpeed-MM's ``forward_step`` calls ``next(data_iterator)`` on every pipeline stage, and a
later stage does so only after it received the previous stage's activation.  Here the same
happens on CPU over gloo: a tiny GPTModel split over 2 (and 4) pipeline ranks, one
``FlowDataLoader`` decoding on pipeline rank 0 (the other ranks are given a corpus path that
does not exist, so whatever they train on came over the wire), wrapped as the real job wraps
it (``FlowTrainIterator`` inside Megatron's ``RerunDataIterator``), the schedule obtained from
the patched ``get_forward_backward_func`` with feature ``packing`` on: Megatron's own 1F1B
(``--no-flow-schedule``) and the plugin's runtime (``--flow-schedule``), train steps and a
forward-only (evaluation) step.  Before the step hand-off the first ``next()`` of rank 1
waited in a broadcast that rank 0 could only finish after rank 1 received its activation:
the launch timed out.
"""

from __future__ import annotations

import pytest
import torch

from markers import requires_megatron_core

pytestmark = requires_megatron_core

from data_corpus import demo_corpus  # noqa: E402
from megatron_cpu_harness import launch  # noqa: E402

SAMPLES = 24
STEPS = 2
MICROBATCHES = 4


def _tokens(batch, spec):
    """The pack's first ``seq_length`` tokens as the tiny model's input (vocab folded)."""
    ids = batch["input_ids"][:, : spec.seq_length + 1] % spec.vocab_size
    if ids.shape[1] < spec.seq_length + 1:
        ids = torch.nn.functional.pad(ids, (0, spec.seq_length + 1 - ids.shape[1]))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _worker(rank, world_size, corpus, flags):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron_cpu_harness import TinyGPTSpec, build_stage_model, megatron_parallel

    from mindspeed_flow.activation import deactivate
    from mindspeed_flow.adapters.mindspeed_mm.data import FlowTrainIterator
    from mindspeed_flow.data import FlowDataLoader
    from mindspeed_flow.patches import activate

    spec = TinyGPTSpec(num_microbatches=MICROBATCHES, micro_batch_size=1)
    seen: list[list[str]] = []

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)  # every stage, as MindSpeed-MM's get_batch
        seen.append(list(batch["sample_ids"]))
        tokens, labels = _tokens(batch, spec)
        positions = torch.arange(spec.seq_length).unsqueeze(0)
        return model(tokens, positions, None, labels=labels), loss_func

    activate(flags, environ={})
    try:
        with megatron_parallel(pipeline_parallel_size=world_size):
            from megatron.core.pipeline_parallel import get_forward_backward_func

            group = parallel_state.get_model_parallel_group()
            source = corpus if dist.get_rank() == 0 else corpus + "/does-not-exist"
            loader = FlowDataLoader(source, None, capacity=512, num_workers=0, window=4, group=group,
                                    pp_size=world_size, step_packs=MICROBATCHES, max_pixels=112 * 112)
            train = RerunDataIterator(FlowTrainIterator(loader))
            model = build_stage_model(spec)
            losses, grads = [], 0
            for forward_only in [False] * STEPS + [True]:
                model.zero_grad(set_to_none=True)
                schedule = get_forward_backward_func()
                out = schedule(forward_step_func=forward_step, data_iterator=train, model=[model],
                               num_microbatches=MICROBATCHES, seq_length=spec.seq_length,
                               micro_batch_size=1, forward_only=forward_only)
                losses.append([float(d["loss"]) for d in out])
                grads = max(grads, sum(1 for p in model.parameters() if p.grad is not None))
    finally:
        deactivate()
    return {"decoding": loader.decoding, "packs": loader.stats.packs, "seen": seen, "losses": losses,
            "grads": grads, "handoffs": train.iterable.handoffs, "schedule": getattr(schedule, "__name__", "")}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo_corpus(tmp_path_factory, samples=SAMPLES)


def _check(results, world_size):
    first, last = results[0], results[-1]
    assert [r["decoding"] for r in results] == [True] + [False] * (world_size - 1)
    assert first["packs"] == (STEPS + 1) * MICROBATCHES  # decoded once, on the first stage
    assert all(r["packs"] == 0 for r in results[1:])  # later stages decoded nothing
    assert len(first["seen"]) == (STEPS + 1) * MICROBATCHES
    for r in results[1:]:
        assert r["seen"] == first["seen"]  # every stage trained on the first stage's batches
    assert all(r["handoffs"] == STEPS + 1 for r in results)  # one collective per step
    assert [len(step) for step in last["losses"]] == [MICROBATCHES] * (STEPS + 1)
    assert all(r["grads"] > 0 for r in results)


@pytest.mark.parametrize("flags", [["--flow-packing"], ["--flow-packing", "--flow-schedule"]],
                         ids=["megatron-1f1b", "flow-runtime"])
def test_pp2_packing_loader_runs_under_the_schedule(corpus, flags):
    _check(launch(_worker, 2, str(corpus), flags, timeout_s=150), 2)


def test_pp4_packing_loader_runs_under_the_flow_runtime(corpus):
    _check(launch(_worker, 4, str(corpus), ["--flow-packing", "--flow-schedule"], timeout_s=240), 4)


def _interleaved_worker(rank, world_size, corpus, flags):
    """PP=2 with two model chunks per rank: chunk 1's iterator is a ChunkView of chunk 0's."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron_cpu_harness import TinyGPTSpec, build_interleaved_chunks, megatron_virtual_parallel

    from mindspeed_flow.activation import deactivate
    from mindspeed_flow.adapters.mindspeed_mm.data import FlowTrainIterator
    from mindspeed_flow.data import FlowDataLoader
    from mindspeed_flow.data.handoff import ChunkView
    from mindspeed_flow.patches import activate

    spec = TinyGPTSpec(num_microbatches=MICROBATCHES, micro_batch_size=1)
    seen: dict[int, list] = {0: [], 1: []}

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        seen[chunks.index(model)].append(list(batch["sample_ids"]))
        tokens, labels = _tokens(batch, spec)
        positions = torch.arange(spec.seq_length).unsqueeze(0)
        return model(tokens, positions, None, labels=labels), loss_func

    activate(flags, environ={})
    try:
        with megatron_virtual_parallel(world_size, 2):
            from megatron.core.pipeline_parallel import get_forward_backward_func

            source = corpus if dist.get_rank() == 0 else corpus + "/does-not-exist"
            loader = FlowDataLoader(source, None, capacity=512, num_workers=0, window=4,
                                    group=parallel_state.get_model_parallel_group(), pp_size=world_size,
                                    step_packs=MICROBATCHES, max_pixels=112 * 112)
            primary = FlowTrainIterator(loader)
            iterators = [RerunDataIterator(primary), RerunDataIterator(ChunkView(primary))]
            chunks = build_interleaved_chunks(spec, 2)
            losses = []
            for forward_only in [False] * STEPS + [True]:
                out = get_forward_backward_func()(
                    forward_step_func=forward_step, data_iterator=iterators, model=chunks,
                    num_microbatches=MICROBATCHES, seq_length=spec.seq_length, micro_batch_size=1,
                    forward_only=forward_only)
                losses.append(len(out))
    finally:
        deactivate()
    return {"packs": loader.stats.packs, "seen": seen, "losses": losses, "handoffs": primary.handoffs}


@pytest.mark.parametrize("flags", [["--flow-packing"], ["--flow-packing", "--flow-schedule"]],
                         ids=["megatron-interleaved", "flow-runtime"])
def test_interleaved_chunks_share_one_loader(corpus, flags):
    first, last = launch(_interleaved_worker, 2, str(corpus), flags, timeout_s=150)
    assert first["packs"] == (STEPS + 1) * MICROBATCHES and last["packs"] == 0  # decoded once per replica
    assert all(r["handoffs"] == STEPS + 1 for r in (first, last))
    for r in (first, last):
        assert r["seen"][1] == r["seen"][0] == first["seen"][0]  # each chunk, each stage: stage 0's packs
    assert last["losses"] == [MICROBATCHES] * (STEPS + 1)


def _failure_worker(rank, world_size):
    import torch.distributed as dist

    from mindspeed_flow.data import broadcast

    group = dist.new_group([0, 1])
    if rank == 0:
        broadcast.send_failure("ValueError: corrupt_image: a.jsonl sample 3 (policy: fail)", 0, group,
                               torch.device("cpu"))
        return "sent"
    try:
        broadcast.receive_step(0, group, torch.device("cpu"))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_decoder_failure_reaches_the_waiting_peers():
    """The decoding rank failing while it makes a step's batches tells its peers, which are
    waiting in the hand-off, instead of leaving them in the collective."""
    _, peer = launch(_failure_worker, 2, timeout_s=60)
    assert peer == ("the decoding rank 0 failed to produce this step's batches: "
                    "ValueError: corrupt_image: a.jsonl sample 3 (policy: fail)")
