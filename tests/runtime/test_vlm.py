"""`<transpose, 1f1b>` on the tiny VLM (:mod:`mindspeed_flow.train.model`: its ViT in front of
megatron-core's GPTModel cut over PP=2), run by the runtime over gloo, against one process
running the whole model (fp32, 1e-6 relative), with the ViT frozen and trainable.

Microbatch ``m`` is an image of ``PATCHES[m]`` merged image tokens followed by text tokens:
its sequence length differs per microbatch, and nothing is padded.  The ViT is replicated: rank
``m % 2`` runs it for microbatch ``m`` and sends the embeddings to the pipeline's first
stage; a trainable ViT is broadcast from rank 0 first (rank 1 starts from other weights)
and its gradients are summed over both replicas at the end.
"""

from __future__ import annotations

import pytest
import torch

from tiny_vlm import CONFIG, StageModule, forward_step, gpt_stage, vlm_items
from tiny_vlm import vit as tiny_vit
from markers import requires_megatron_core

pytestmark = requires_megatron_core

MICROBATCHES = 4
PATCHES = (3, 6, 2, 5)
TEXT = 5
LAYERS = CONFIG.llm_layers
SPLIT = [LAYERS // 2, LAYERS - LAYERS // 2]
SEQ_LENGTH = max(PATCHES) + TEXT  # what Megatron's schedules are told (variable lengths are exchanged)


def _batches():
    return vlm_items(PATCHES, TEXT, seed=11)


def _vit(frozen):
    return tiny_vit(frozen=frozen)


def _reference_then_pipelined(rank, world_size):
    """Worker, one launch: first the whole VLM in this process alone (PP=1, Megatron's
    no-pipelining schedule, no communication), with the ViT frozen and trainable; then the
    runtime at PP=2 from the reference's GPT weights.  Returns (reference, pipelined)."""
    reference = {frozen: _reference_run(frozen) for frozen in (True, False)}
    state = reference[True][0]  # the GPT weights are the same in both cases
    assert all(torch.equal(state[k], v) for k, v in reference[False][0].items() if isinstance(v, torch.Tensor))
    return reference, _pipelined(rank, world_size, state)


def _reference_run(frozen):
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron_cpu_harness import full_state_dict, megatron_parallel

    with megatron_parallel(1):
        gpt = gpt_stage([LAYERS], 0)
        vit = _vit(frozen)
        state = full_state_dict(gpt)

        losses = forward_backward_no_pipelining(
            forward_step_func=forward_step, data_iterator=iter(_batches()), model=StageModule(gpt, vit=vit),
            num_microbatches=MICROBATCHES, seq_length=SEQ_LENGTH, micro_batch_size=1)
        grads = {f"gpt.{n}": p.grad.clone() for n, p in gpt.named_parameters()}
        grads.update({f"vit.{n}": p.grad.clone() for n, p in vit.named_parameters() if p.grad is not None})
    return state, [float(d["loss"]) for d in losses], grads


def _pipelined(rank, world_size, state):
    """Worker: this rank's GPT stage and a whole ViT replica, run by the runtime."""
    return {frozen: _pipelined_run(rank, world_size, state, frozen) for frozen in (True, False)}


def _pipelined_run(rank, world_size, state, frozen):
    from megatron_cpu_harness import global_name, layer_offset, megatron_parallel

    from mindspeed_flow.runtime import Binding, Executor
    from mindspeed_flow.runtime.layout import plan_for, vlm_layout

    with megatron_parallel(world_size):
        gpt = gpt_stage(SPLIT, rank, state)
        vit = _vit(frozen)
        if rank == 1 and not frozen:
            with torch.no_grad():
                for p in vit.parameters():
                    p.add_(0.5)  # only the broadcast makes this replica right
        plan = plan_for(vlm_layout([CONFIG.vit_layers, 0], SPLIT, transpose=True, vision_trainable=not frozen),
                        MICROBATCHES)
        data = iter(_batches())
        bindings = {("vit", 0): Binding(vit, data), ("llm", rank): Binding(StageModule(gpt), data)}
        result = Executor(rank, [0, 1]).run(plan, forward_step, bindings)
        offset = layer_offset(gpt)
        grads = {f"gpt.{global_name(n, offset)}": p.grad.clone() for n, p in gpt.named_parameters()}
        grads.update({f"vit.{n}": p.grad.clone() for n, p in vit.named_parameters() if p.grad is not None})
    return [float(d["loss"]) for d in result.forward_data_store], grads


@pytest.fixture(scope="module")
def runs():
    from megatron_cpu_harness import launch

    (reference, first), (same_reference, last) = launch(_reference_then_pipelined, 2, timeout_s=300)
    for frozen in (True, False):  # each rank computed the reference alone: the same numbers
        assert reference[frozen][1] == same_reference[frozen][1]
    return reference, [first, last]


@pytest.mark.parametrize("frozen", [True, False], ids=["frozen-vit", "trainable-vit"])
def test_transpose_1f1b_vlm_equals_single_process(runs, frozen):
    reference, ranks = runs
    _, ref_losses, ref_grads = reference[frozen]
    first, last = (r[frozen] for r in ranks)
    assert first[0] == [] and last[0] == pytest.approx(ref_losses, rel=1e-6, abs=0)
    assert any(n.startswith("vit.") for n in ref_grads) is not frozen
    for rank, (_, grads) in enumerate((first, last)):
        vit = {n for n in grads if n.startswith("vit.")}
        assert vit == {n for n in ref_grads if n.startswith("vit.")}  # every replica has the sum
    merged = {**first[1], **last[1]}
    assert set(merged) == set(ref_grads)
    for name, expected in ref_grads.items():
        assert expected.abs().sum() > 0, name
        for rank, (_, grads) in enumerate((first, last)):
            if name in grads:
                torch.testing.assert_close(grads[name], expected, rtol=1e-6, atol=1e-7, msg=f"r{rank} {name}")
