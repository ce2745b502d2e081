"""The profiler runs megatron-core's real transformer layers with TP 2 over gloo (two
spawned processes) and returns points whose FLOP counts rest on the same weights the
allocator's ModuleSpec counts."""

from __future__ import annotations

import pytest

from mindspeed_flow.allocator import Profile, ProxyModel, ClusterSpec

pytest.importorskip("megatron.core")


def test_tp2_block_is_measured_on_megatron_layers(tmp_path):
    from mindspeed_flow.adapters.megatron.profile import BlockShape, measure

    shapes = [BlockShape("backbone", layers=2, hidden=64, heads=4, ffn=176, query_groups=2, tp=2,
                         micro_batch=mbs, seq=seq) for mbs, seq in ((1, 32), (2, 64))]
    shapes += [BlockShape("encoder", layers=1, hidden=64, heads=4, ffn=176, query_groups=4, tp=2,
                          micro_batch=1, seq=64)]
    measured = measure(shapes, warmup=1, repeats=2)
    for shape, point, weights in zip(shapes, measured.points, measured.weights):
        spec = shape.spec()
        # Megatron's matrices on one TP rank are exactly what the allocator counts.
        assert weights == spec.layer_params * shape.layers // 2
        assert point.flops == pytest.approx(shape.layers * spec.layer_forward_flops(shape.micro_batch) / 2)
        assert (point.module, point.tp, point.micro_batch, point.seq, point.hidden) == (
            shape.module, 2, shape.micro_batch, shape.seq, shape.hidden)
        assert 0 < point.forward_s < 10 and 0 < point.backward_s < 10
    assert measured.peak_tflops > 0
    profile = Profile("cpu test", measured.peak_tflops, measured.points, tp_link_gbps=2.0)
    assert Profile.load(profile.save(tmp_path / "p.json")) == profile
    with pytest.raises(ValueError, match="no tp=1 points"):  # the proxy needs TP 1 points
        ProxyModel(profile, ClusterSpec(devices=8))


def test_profiling_device_is_selected_at_run_time_and_a_missing_one_is_named():
    """Here (no GPU, no torch_npu) ``auto`` is the CPU over gloo, and a requested CUDA or
    NPU device is refused, naming what is missing, before any process starts."""
    import torch

    from mindspeed_flow.adapters.megatron.profile import BlockShape, measure
    from mindspeed_flow.adapters.devices.profile import DeviceUnavailableError, select_device

    if torch.cuda.is_available():
        pytest.skip("this test describes a machine without CUDA")
    assert select_device("auto", 2).dist_backend == "gloo"
    assert select_device("cpu", 1).kind == "cpu"
    with pytest.raises(DeviceUnavailableError, match=r"'cuda' requested but torch.cuda.is_available\(\) is False"):
        select_device("cuda", 1)
    with pytest.raises(DeviceUnavailableError, match="'npu' requested but torch_npu cannot be imported"):
        select_device("npu", 1)
    with pytest.raises(ValueError, match="must be one of"):
        select_device("tpu", 1)
    shape = BlockShape("backbone", layers=1, hidden=64, heads=4, ffn=176, query_groups=2, tp=2, micro_batch=1, seq=32)
    with pytest.raises(DeviceUnavailableError, match="'cuda' requested"):
        measure([shape], device="cuda")


def test_cuda_selection_with_a_mocked_gpu_count(monkeypatch):
    """MOCK: torch.cuda's availability and device count are faked (no GPU can exist here)
    to check that CUDA means nccl, that ``auto`` prefers it, and that too few GPUs for the
    TP size are named; the CPU path then refuses to run on such a machine."""
    import torch

    from mindspeed_flow.adapters.devices.profile import DeviceUnavailableError, select_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert select_device("auto", 2) == select_device("cuda", 2)
    assert select_device("cuda", 2).dist_backend == "nccl"
    with pytest.raises(DeviceUnavailableError, match="TP 4 needs 4 devices, found 2"):
        select_device("cuda", 4)
    with pytest.raises(DeviceUnavailableError, match="'cpu' requested on a CUDA machine"):
        select_device("cpu", 1)


def test_profiling_script_refuses_a_missing_device_before_measuring(tmp_path):
    """``scripts/profile_allocator.py --device cuda`` on a machine without a GPU (this one)
    stops at once with one error line naming what is missing: no traceback, no process
    spawned, no profile written."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if torch.cuda.is_available():
        pytest.skip("this test describes a machine without CUDA")
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "p.yaml"
    proc = subprocess.run([sys.executable, str(root / "scripts" / "profile_allocator.py"), "--device", "cuda",
                           "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: device 'cuda' requested but torch.cuda.is_available() is False: no CUDA device on this machine "
        "(profile the CPU with --device cpu)")
    assert "Traceback" not in proc.stderr and "tp sizes" not in proc.stderr and not out.exists()
