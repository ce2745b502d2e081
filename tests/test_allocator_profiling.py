"""The profiler runs megatron-core's real transformer layers with TP 2 over gloo (two
spawned processes) and returns points whose FLOP counts rest on the same weights the
allocator's ModuleSpec counts."""

from __future__ import annotations

import pytest

from mindspeed_flow.allocator import Profile, ProxyModel, ClusterSpec

pytest.importorskip("megatron.core")


def test_tp2_block_is_measured_on_megatron_layers(tmp_path):
    from mindspeed_flow.adapters.megatron_core_profile import BlockShape, measure

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
