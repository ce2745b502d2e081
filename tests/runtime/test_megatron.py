"""The runtime against megatron-core's real schedules, on CPU over gloo.

In one process per rank, the same model chunks run one step under Megatron's schedule and
one under ours (``flow_forward_backward``, what the patched ``get_forward_backward_func``
returns); losses and every gradient must be equal bit for bit.  Variable-length microbatches
(no padding to a common length) run through our PP=2 and are compared with a single-process
run of the whole model.  Two launches in all: PP=2 (every case, and the single-process
reference computed by each rank alone first), PP=4.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from markers import requires_megatron_core

pytestmark = requires_megatron_core

VARLEN = (16, 9, 13, 5)  # sequence length of each microbatch


def _batches(spec, lengths=None):
    """The harness's batches, or one batch per length in ``lengths`` (same seed)."""
    from megatron_cpu_harness import make_microbatches

    if lengths is None:
        return make_microbatches(spec)
    g = torch.Generator().manual_seed(spec.seed + 1)
    out = []
    for i, n in enumerate(lengths):
        seq = torch.randint(0, spec.vocab_size, (spec.micro_batch_size, n + 1), generator=g)
        out.append({"tokens": seq[:, :-1], "labels": seq[:, 1:],
                    "position_ids": torch.arange(n).expand(spec.micro_batch_size, -1), "index": torch.tensor(i)})
    return out


def _forward_step(three_values=False, non_loss=False):
    def loss_func(output, non_loss_data=False):
        if non_loss_data:
            return {"mean": output.detach().float().mean()}
        if three_values:
            total = output.float().sum()
            return total, torch.tensor(output.numel(), dtype=torch.int), {"sum": total.detach().clone()}
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        return model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), loss_func

    return forward_step


def _step(schedule, chunks, iterators, spec, forward_only=False, three_values=False, non_loss=False,
          forward_step=None, **newer):
    """One step; returns (loss data, {chunk.param name: grad})."""
    for c in chunks:
        c.zero_grad(set_to_none=True)
    out = schedule(forward_step_func=forward_step or _forward_step(three_values), data_iterator=iterators,
                   model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=spec.num_microbatches,
                   seq_length=spec.seq_length, micro_batch_size=spec.micro_batch_size, forward_only=forward_only,
                   collect_non_loss_data=non_loss, **newer)
    grads = {f"{i}.{n}": p.grad.clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()
             if p.grad is not None}
    return [{k: float(v) for k, v in d.items()} for d in out], grads


def _diff(theirs, ours):
    """(losses equal?, set of grad names equal?, max abs grad diff, number of grads)."""
    (l1, g1), (l2, g2) = theirs, ours
    worst = max((float((g1[k] - g2[k]).abs().max()) for k in g1 if k in g2), default=float("inf"))
    return {"losses": l1 == l2, "n_losses": len(l2), "names": set(g1) == set(g2), "max_abs": worst,
            "grads": len(g1), "nonzero": all(float(g.abs().sum()) > 0 for g in g1.values())}


def _distinct(model, seed):
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))


def _one_f_one_b_cases(rank, world_size, with_varlen):
    """Worker: Megatron's 1F1B vs ours (2- and 3-value losses, forward only, non-loss data);
    with PP=2 also interleaved, and (``with_varlen``) variable lengths against the
    single-process reference, which each rank first computes alone (PP=1, no communication)
    in the same launch."""
    from megatron.core.pipeline_parallel import schedules
    from megatron_cpu_harness import TinyGPTSpec, build_stage_model, megatron_parallel

    from mindspeed_flow.adapters.megatron.schedule import flow_forward_backward

    spec = TinyGPTSpec(num_microbatches=4)
    megatron = schedules.forward_backward_pipelining_without_interleaving
    out = {}
    varlen_state = None
    if with_varlen:
        out["varlen_reference"] = _varlen_reference()
        varlen_state = out["varlen_reference"][0]
    with megatron_parallel(pipeline_parallel_size=world_size):
        model = build_stage_model(spec)
        _distinct(model, spec.seed + rank)

        def both(**kw):
            return [_step(s, [model], iter(_batches(spec)), spec, **kw) for s in (megatron, flow_forward_backward)]

        out["1f1b"] = _diff(*both())
        out["1f1b-3value"] = _diff(*both(three_values=True))
        theirs, ours = both(forward_only=True)
        out["forward_only"] = {"losses": theirs[0] == ours[0], "n": len(ours[0]), "grads": len(ours[1])}
        theirs, ours = both(forward_only=True, non_loss=True)
        out["non_loss"] = {"equal": theirs[0] == ours[0], "n": len(ours[0])}
        if varlen_state is not None:
            from megatron_cpu_harness import build_stage_model as build

            varlen = build(TinyGPTSpec(num_microbatches=len(VARLEN), seq_length=max(VARLEN)), varlen_state)
            vspec = TinyGPTSpec(num_microbatches=len(VARLEN), seq_length=max(VARLEN))
            out["varlen"] = _step(flow_forward_backward, [varlen], iter(_batches(vspec, VARLEN)), vspec)
            from megatron_cpu_harness import global_name, layer_offset

            offset = layer_offset(varlen)
            out["varlen"] = (out["varlen"][0], {global_name(k[2:], offset): v for k, v in out["varlen"][1].items()})
        if world_size == 2:
            out.update(_patched(model, spec, megatron))
            out["ddp"] = _under_megatron_ddp(spec, megatron)
    if world_size == 2:
        out["interleaved"] = _interleaved(world_size)
    return out


def _under_megatron_ddp(spec, megatron):
    """A training job's setting: Megatron's DDP with overlapped gradient reduction, its
    ``no_sync`` and ``finalize_model_grads`` in the config.  Our schedule must release
    ``no_sync`` before the last backward (else DDP finds no reduction issued) and give the
    same reduced gradients (``main_grad``) as Megatron's."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron_cpu_harness import build_stage_model

    from mindspeed_flow.adapters.megatron.schedule import flow_forward_backward

    model = build_stage_model(spec)
    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        overlap_grad_reduce=True, grad_reduce_in_fp32=True))
    model.config.no_sync_func, model.config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    grads = []
    for schedule in (megatron, flow_forward_backward):
        ddp.zero_grad_buffer()
        schedule(forward_step_func=_forward_step(), data_iterator=iter(_batches(spec)), model=[ddp],
                 num_microbatches=spec.num_microbatches, seq_length=spec.seq_length,
                 micro_batch_size=spec.micro_batch_size)
        grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
    return {"max_abs": max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0]),
            "nonzero": all(float(g.abs().sum()) > 0 for g in grads[1].values()), "grads": len(grads[1])}


def _patched(model, spec, megatron):
    """With feature ``schedule`` on, Megatron's getter (package re-export and module) hands
    out our function, which ignores newer keywords and equals Megatron; off again, Megatron's."""
    import megatron.core.pipeline_parallel as package
    from megatron.core.pipeline_parallel import schedules

    from mindspeed_flow.activation import deactivate
    from mindspeed_flow.adapters.megatron.schedule import flow_forward_backward
    from mindspeed_flow.patches import activate

    activate(["--flow-schedule"], environ={})
    try:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        ours = get_forward_backward_func()
        found = {"ours": ours is flow_forward_backward and package.get_forward_backward_func() is ours
                 and schedules.get_forward_backward_func() is ours}
        runs = [_step(megatron, [model], iter(_batches(spec)), spec),
                _step(ours, [model], iter(_batches(spec)), spec, adjust_tensor_shapes_fn=None)]
    finally:
        deactivate()
    found["restored"] = schedules.get_forward_backward_func() is megatron
    return {"patched": found, "patched_run": _diff(*runs)}


def _interleaved(world_size, chunks_per_rank=2):
    """Megatron's interleaved schedule vs ours over two one-layer chunks per rank."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving
    from megatron_cpu_harness import TinyGPTSpec, build_interleaved_chunks, megatron_virtual_parallel

    from mindspeed_flow.adapters.megatron.schedule import flow_forward_backward

    from megatron.core import parallel_state

    spec = TinyGPTSpec(num_microbatches=4)
    seen: list[tuple[str, int, int]] = []  # (F or B, chunk, virtual pipeline rank then)

    def recording(data_iterator, model):
        chunk = chunks.index(model)
        seen.append(("F", chunk, parallel_state.get_virtual_pipeline_model_parallel_rank()))
        output, loss_func = _forward_step()(data_iterator, model)
        output.register_hook(lambda g: seen.append(("B", chunk, parallel_state.get_virtual_pipeline_model_parallel_rank())))
        return output, loss_func

    with megatron_virtual_parallel(world_size, chunks_per_rank):
        chunks = build_interleaved_chunks(spec, chunks_per_rank)
        runs, virtual = [], []
        for s in (forward_backward_pipelining_with_interleaving, flow_forward_backward):
            seen.clear()
            # MindSpeed-MM leaves the virtual rank at the last chunk after building its data iterators
            parallel_state.set_virtual_pipeline_model_parallel_rank(chunks_per_rank - 1)
            runs.append(_step(s, chunks, [iter(_batches(spec)) for _ in chunks], spec, forward_step=recording))
            virtual.append(sorted(set(seen)))
        after = parallel_state.get_virtual_pipeline_model_parallel_rank()
    return {**_diff(*runs), "virtual": virtual, "restored": after == chunks_per_rank - 1}


def _varlen_reference():
    """The whole model in this process alone, Megatron's no-pipelining schedule (no p2p, so
    any lengths), over the variable-length microbatches."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_no_pipelining
    from megatron_cpu_harness import TinyGPTSpec, build_stage_model, full_state_dict, megatron_parallel

    spec = TinyGPTSpec(num_microbatches=len(VARLEN), seq_length=max(VARLEN))
    with megatron_parallel(1):
        model = build_stage_model(spec)
        _distinct(model, spec.seed)
        state = full_state_dict(model)
        losses, grads = _step(forward_backward_no_pipelining, [model], iter(_batches(spec, VARLEN)), spec)
    return state, losses, {k[2:]: v for k, v in grads.items()}


@pytest.fixture(scope="module")
def pp2():
    from megatron_cpu_harness import launch

    return launch(_one_f_one_b_cases, 2, True, timeout_s=300)


@pytest.fixture(scope="module")
def varlen_reference(pp2):
    assert all(torch.equal(a, b) for a, b in zip(pp2[0]["varlen_reference"][2].values(),
                                                   pp2[1]["varlen_reference"][2].values()))
    return pp2[0]["varlen_reference"]


def _exact(ranks, case):
    """Same losses (the last stage has one per microbatch, the others none) and every
    gradient equal, max abs difference 0."""
    for i, rank in enumerate(ranks):
        found = rank[case]
        assert found["losses"] and found["names"] and found["nonzero"] and found["grads"] > 0, found
        assert found["n_losses"] == (4 if i == len(ranks) - 1 else 0), found
        assert found["max_abs"] == 0.0, found


@pytest.mark.parametrize("case", ["1f1b", "1f1b-3value"])
def test_1f1b_pp2_equals_megatron_bit_for_bit(pp2, case):
    _exact(pp2, case)


def test_interleaved_pp2_equals_megatron_bit_for_bit(pp2):
    _exact(pp2, "interleaved")


def test_interleaved_sets_the_virtual_pipeline_rank_per_chunk_as_megatron(pp2):
    """Issue 19, defect 9: each chunk's forward and backward run under its own virtual
    pipeline rank (Float16Module and is_pipeline_first/last_stage read it), as in Megatron's
    interleaved schedule, whatever rank was set before the step; the rank is put back after.
    Megatron 0.12 sets the global rank per chunk itself; later versions pass each chunk its
    ``vp_stage`` instead and leave the global alone, so there only our order is checked."""
    import importlib.metadata

    per_chunk = [(kind, c, c) for kind in "BF" for c in range(2)]
    sets_global = tuple(int(p) for p in importlib.metadata.version("megatron-core").split(".")[:2]) < (0, 13)
    for rank in pp2:
        theirs, ours = rank["interleaved"]["virtual"]
        assert ours == per_chunk, ours
        if sets_global:
            assert theirs == per_chunk, theirs
        assert rank["interleaved"]["restored"]


def test_patched_getter_returns_the_runtime_and_changes_no_number(pp2):
    for rank in pp2:
        assert rank["patched"] == {"ours": True, "restored": True}
    _exact(pp2, "patched_run")


def test_under_megatron_ddp_with_overlapped_grad_reduce_equals_megatron(pp2):
    for rank in pp2:
        assert rank["ddp"]["grads"] > 0 and rank["ddp"]["nonzero"] and rank["ddp"]["max_abs"] == 0.0, rank["ddp"]


def test_forward_only_returns_megatrons_losses(pp2):
    first, last = pp2
    assert first["forward_only"] == {"losses": True, "n": 0, "grads": 0}
    assert last["forward_only"] == {"losses": True, "n": 4, "grads": 0}
    assert last["non_loss"] == {"equal": True, "n": 4} and first["non_loss"]["n"] == 0


def test_variable_length_microbatches_equal_single_process(pp2, varlen_reference):
    _, ref_losses, ref_grads = varlen_reference
    losses = pp2[1]["varlen"][0]
    grads = {**pp2[0]["varlen"][1], **pp2[1]["varlen"][1]}
    assert [d["loss"] for d in losses] == pytest.approx([d["loss"] for d in ref_losses], rel=1e-6, abs=0)
    assert set(grads) == set(ref_grads)
    for name, expected in ref_grads.items():
        torch.testing.assert_close(grads[name], expected, rtol=1e-6, atol=1e-7, msg=name)


def test_1f1b_pp4_equals_megatron_bit_for_bit():
    from megatron_cpu_harness import launch

    _exact(launch(_one_f_one_b_cases, 4, False, timeout_s=300), "1f1b")
