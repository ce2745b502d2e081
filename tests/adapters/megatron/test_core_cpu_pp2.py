"""megatron-core's real schedules on CPU: PP=2 1F1B over gloo equals the single-process
reference, and the CPU shims that make this possible do what they say and undo cleanly."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import multiprocessing
import re
import sys
import time

import pytest
import torch

from megatron_cpu_harness import (
    ONE_F_ONE_B,
    HarnessError,
    TinyGPTSpec,
    launch,
    merge_stage_results,
    run_pipelined,
    run_reference,
)
from mindspeed_flow.adapters.megatron import core as adapter

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None
    or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install 'mindspeed-flow[megatron]')",
)
cpu_only = pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU shims are never applied on a device machine"
)

SPEC = TinyGPTSpec()


@pytest.fixture(scope="module")
def reference():
    return run_reference(SPEC)


@pytest.fixture(scope="module")
def stages(reference):
    return run_pipelined(SPEC, reference.state_dict, ONE_F_ONE_B, pipeline_parallel_size=2)


# --------------------------------------------------------------------------- PP=2 vs reference


@cpu_only
def test_pp2_losses_match_reference(reference, stages):
    merged = merge_stage_results(stages)
    assert len(reference.result.losses) == SPEC.num_microbatches
    assert merged.losses == pytest.approx(reference.result.losses, rel=0, abs=1e-6)
    assert stages[0].losses == []  # only the last stage computes the loss


@cpu_only
def test_pp2_every_gradient_matches_reference(reference, stages):
    state = reference.state_dict
    weights = {name for name, value in state.items() if isinstance(value, torch.Tensor)}
    assert set(reference.result.grads) == weights  # every weight got a gradient
    merged = merge_stage_results(stages)
    assert set(merged.grads) == weights
    for name, expected in reference.result.grads.items():
        assert expected.abs().sum() > 0, f"{name}: zero gradient compares nothing"
        torch.testing.assert_close(merged.grads[name], expected, rtol=0, atol=1e-6, msg=name)


@cpu_only
def test_pp2_stages_hold_their_layers_under_global_names(stages):
    def layers(stage):
        names = [name for name in stage.grads if name.startswith("decoder.layers.")]
        return {int(name.split(".")[2]) for name in names}

    first, last = stages
    assert (first.pipeline_rank, last.pipeline_rank) == (0, 1)
    assert layers(first) == {0, 1} and layers(last) == {2, 3}
    assert "embedding.word_embeddings.weight" in first.grads
    assert "output_layer.weight" in last.grads and "output_layer.weight" not in first.grads


@cpu_only
def test_recorded_order_is_1f1b_on_each_rank(reference, stages):
    def order(events):
        return [f"{e.kind}{e.microbatch}" for e in events]

    assert order(reference.result.events) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert order(stages[0].events) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert order(stages[1].events) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert {e.rank for e in stages[1].events} == {1}


# --------------------------------------------------------------------------- the launcher


def _fail_on_rank_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("deliberate failure on rank one")
    torch.distributed.barrier()  # rank 0 blocks: the launcher must stop it
    return rank


def _sleep(rank: int, world_size: int, seconds: float) -> None:
    time.sleep(seconds)


def _harness_children() -> list:
    return [p for p in multiprocessing.active_children() if p.name.startswith("megatron-cpu-rank")]


def test_launch_names_the_failing_rank_and_stops_the_others():
    with pytest.raises(HarnessError) as failure:
        launch(_fail_on_rank_one, 2, timeout_s=60)
    # The cause comes first, though rank 0's report ("connection closed") may arrive first.
    assert str(failure.value).startswith("rank 1 failed first")
    assert "ValueError: deliberate failure on rank one" in str(failure.value)
    assert _harness_children() == []


def test_launch_times_out_and_stops_its_processes():
    started = time.monotonic()
    with pytest.raises(HarnessError, match=r"no result from ranks \[0\] \(timed out after 3 s\)"):
        launch(_sleep, 1, 120.0, timeout_s=3)
    assert time.monotonic() - started < 30
    assert _harness_children() == []


# --------------------------------------------------------------------------- the shims


@pytest.fixture
def shims():
    handle = adapter.enable_cpu_shims()
    yield handle
    handle.remove()


@cpu_only
def test_shims_send_cuda_requests_to_the_cpu(shims):
    from megatron.core import tensor_parallel

    assert torch.zeros(2, device="cuda").device.type == "cpu"
    assert torch.ones(2, device=torch.device("cuda", 0)).device.type == "cpu"
    tensor = torch.arange(3)
    assert tensor.cuda() is tensor
    assert tensor.to("cuda").device.type == "cpu"
    assert tensor.to(device="cuda", dtype=torch.float64).dtype == torch.float64
    assert torch.cuda.current_device() == torch.device("cpu")
    assert torch.cuda.synchronize() is None  # Megatron's variable_seq_lengths p2p calls it
    with tensor_parallel.get_cuda_rng_tracker().fork():  # the training tracker needs CUDA
        pass


@cpu_only
def test_enable_is_idempotent(shims):
    modes = len(torch.overrides._get_current_function_mode_stack())
    assert adapter.enable_cpu_shims() is shims
    assert len(torch.overrides._get_current_function_mode_stack()) == modes
    assert shims.active


@cpu_only
def test_remove_restores_original_behaviour():
    from megatron.core.tensor_parallel import random as mp_random

    original_current_device = torch.cuda.current_device
    original_synchronize = torch.cuda.synchronize
    original_tracker = mp_random._CUDA_RNG_STATE_TRACKER
    modes = len(torch.overrides._get_current_function_mode_stack())

    handle = adapter.enable_cpu_shims()
    assert mp_random._CUDA_RNG_STATE_TRACKER is not original_tracker
    handle.remove()
    handle.remove()  # a second remove does nothing

    assert not handle.active
    assert torch.cuda.current_device is original_current_device
    assert torch.cuda.synchronize is original_synchronize
    assert mp_random._CUDA_RNG_STATE_TRACKER is original_tracker
    assert len(torch.overrides._get_current_function_mode_stack()) == modes
    with pytest.raises((AssertionError, RuntimeError)):  # no CUDA on this machine
        torch.zeros(1, device="cuda")
    again = adapter.enable_cpu_shims()
    assert again is not handle and again.active
    again.remove()


def test_shims_refuse_on_a_device_machine(monkeypatch):
    # Stand-in for a device machine: CUDA reports itself available.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    original_current_device = torch.cuda.current_device
    with pytest.raises(RuntimeError, match="never applied on a device machine"):
        adapter.enable_cpu_shims()
    assert torch.cuda.current_device is original_current_device


def test_cpu_safe_config_overrides_follow_the_schedule():
    plain = adapter.cpu_safe_config_overrides()
    interleaved = adapter.cpu_safe_config_overrides(virtual_pipeline_model_parallel_size=2)
    assert plain["batch_p2p_comm"] is False and interleaved["batch_p2p_comm"] is False
    assert plain["overlap_p2p_comm"] is False  # the non-interleaved schedule refuses it
    assert interleaved["overlap_p2p_comm"] is True


# --------------------------------------------------------------------------- version checks


def test_version_is_the_installed_one():
    version = adapter.megatron_core_version()
    assert version == importlib.metadata.version("megatron-core")
    assert adapter.require_megatron_core("0.12") == version


def test_too_old_names_the_installed_version():
    version = adapter.megatron_core_version()
    expected = rf"megatron-core {re.escape(version)} is installed; .* needs >= 999\.1"
    with pytest.raises(adapter.MegatronCoreVersionError, match=expected):
        adapter.require_megatron_core("999.1")


def test_missing_megatron_is_reported(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    monkeypatch.setitem(sys.modules, "megatron.core", None)  # makes `import megatron.core` fail
    with pytest.raises(adapter.MegatronCoreVersionError, match="not importable"):
        adapter.require_megatron_core()
