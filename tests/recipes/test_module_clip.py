"""Per-module gradient clipping on megatron-core's real 1F1B schedule over gloo with PP=2
against a single-process reference: each module's norm spans both stages (reduced over
Megatron's model-parallel group) and the clipped gradients equal the reference's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron_cpu_harness import (
    NO_PIPELINING, ONE_F_ONE_B, TinyGPTSpec, build_stage_model, global_name, launch, layer_offset,
    megatron_parallel, run_reference, run_schedule,
)
from mindspeed_flow.recipes.module_clip import clip_grads_per_module

# embedding and decoder clipped hard, the output layer never: a module clip must leave
# the other modules' gradients alone.
MAX_NORMS = {"embedding": 1e-3, "decoder": 1e-2, "output_layer": 1e9}
SPEC = TinyGPTSpec(num_layers=2, num_microbatches=2)


def clip_worker(rank: int, world_size: int, spec: TinyGPTSpec, state_dict: dict[str, Any]) -> dict:
    from megatron.core import parallel_state, tensor_parallel

    with megatron_parallel(pipeline_parallel_size=world_size):
        model = build_stage_model(spec, state_dict)
        result = run_schedule(model, spec, ONE_F_ONE_B if world_size > 1 else NO_PIPELINING)
        offset = layer_offset(model)
        norms = clip_grads_per_module(
            model.named_parameters(), MAX_NORMS, group=parallel_state.get_model_parallel_group(),
            counts_for_norm=tensor_parallel.param_is_not_tensor_parallel_duplicate)
        grads = {global_name(n, offset): p.grad.detach().clone() for n, p in model.named_parameters()}
        return {"norms": norms, "grads": grads, "unclipped": result.grads}


@pytest.fixture(scope="module")
def runs():
    reference = run_reference(SPEC)
    (single,) = launch(clip_worker, 1, SPEC, reference.state_dict)
    stages = launch(clip_worker, 2, SPEC, reference.state_dict)
    return single, stages


def test_module_norms_span_both_pipeline_stages(runs):
    single, stages = runs
    for stage in stages:
        assert stage["norms"] == pytest.approx(single["norms"], rel=1e-6)
    # the decoder's layers are split between the stages: neither stage alone has its norm
    for stage in stages:
        local = sum(float(g.double().pow(2).sum()) for n, g in stage["unclipped"].items()
                    if n.startswith("decoder.")) ** 0.5
        assert local < single["norms"]["decoder"] * 0.999


def test_clipped_gradients_equal_the_reference(runs):
    single, stages = runs
    merged = {name: g for stage in stages for name, g in stage["grads"].items()}
    assert merged.keys() == single["grads"].keys()
    for name, grad in single["grads"].items():
        torch.testing.assert_close(merged[name], grad, rtol=1e-5, atol=1e-8, msg=name)
    # clipped modules now have their maximum norm; the output layer kept its gradient
    for module in ("embedding", "decoder"):
        norm = sum(float(g.double().pow(2).sum()) for n, g in single["grads"].items()
                   if n.startswith(module + ".")) ** 0.5
        assert single["norms"][module] > MAX_NORMS[module]
        assert norm == pytest.approx(MAX_NORMS[module], rel=1e-4)
    out = "output_layer.weight"
    torch.testing.assert_close(single["grads"][out], single["unclipped"][out], rtol=0, atol=0)


def chained_worker(rank: int, world_size: int, spec: TinyGPTSpec, state_dict: dict[str, Any]) -> dict:
    """The patch on megatron-core's ChainedOptimizer.prepare_grads, flags as on a command line.

    FP32Optimizer's constructor makes a CUDA tensor (its loss scale) that this CPU machine
    cannot: it is built with MegatronOptimizer's constructor and given a CPU scale instead.
    """
    import argparse

    import megatron.core.optimizer as opt_module
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer, MegatronOptimizer

    from megatron_param_groups import megatron_param_groups
    from mindspeed_flow.adapters.megatron import recipes as megatron_core_recipes
    from mindspeed_flow.patches import recipes as recipes_patches
    from mindspeed_flow.patching import PatchRegistry

    registry = PatchRegistry(recipes_patches.PATCHES)
    registry.enable({"recipes"})
    flags = ["decoder=1e-2", "embedding=1e-3"]
    megatron_core_recipes.configure(argparse.Namespace(flow_module_grad_clip=flags))
    with megatron_parallel(pipeline_parallel_size=1):
        model = build_stage_model(spec, state_dict)
        from megatron.core.distributed import DistributedDataParallelConfig
        model.ddp_config = DistributedDataParallelConfig()
        groups = megatron_param_groups([model], 1e-3, 0.0)
        child = FP32Optimizer.__new__(FP32Optimizer)
        MegatronOptimizer.__init__(child, torch.optim.SGD(groups, lr=1e-3), OptimizerConfig(), lambda g: None)
        child._scale, child.is_stub_optimizer = torch.tensor([1.0]), False
        run_schedule(model, spec, NO_PIPELINING)
        expected = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        clip_grads_per_module([(n, _Holder(g)) for n, g in expected.items()], {"decoder": 1e-2, "embedding": 1e-3})
        found_inf = ChainedOptimizer([child]).prepare_grads()
        got = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    registry.remove()
    return {"found_inf": found_inf, "got": got, "expected": expected,
            "unpatched": opt_module._get_param_groups is _get_param_groups}


class _Holder:
    """A parameter stand-in whose ``.grad`` is the tensor to clip (the expected copy)."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad


def test_patched_chained_optimizer_clips_each_module():
    reference = run_reference(SPEC)
    (out,) = launch(chained_worker, 1, SPEC, reference.state_dict)
    assert out["found_inf"] is False and out["unpatched"]
    changed = [n for n in out["got"] if not torch.equal(out["got"][n], reference.result.grads[n])]
    assert changed and all(n.startswith(("decoder.", "embedding.")) for n in changed)
    for name, grad in out["expected"].items():
        torch.testing.assert_close(out["got"][name], grad, rtol=0, atol=0, msg=name)
