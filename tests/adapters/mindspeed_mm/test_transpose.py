"""What the transposed ViT refuses at model build (adapters/mindspeed_mm/transpose.py), without
a world.  The layout itself runs in tests/upstream/test_real_job_transpose.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mindspeed_flow.adapters.errors import TransposeUnsupported
from mindspeed_flow.adapters.mindspeed_mm.transpose import check_supported


def test_a_trainable_vit_with_overlapped_grad_reduce_is_refused_naming_the_flag():
    overlapped = SimpleNamespace(overlap_grad_reduce=True)
    with pytest.raises(TransposeUnsupported, match="trainable ViT and --overlap-grad-reduce"):
        check_supported(overlapped, [2, 0], 2, vpp=False, trainable=True)
    check_supported(overlapped, [2, 0], 2, vpp=False, trainable=False)  # a frozen ViT has no REDUCE
    check_supported(SimpleNamespace(overlap_grad_reduce=False), [2, 0], 2, vpp=False, trainable=True)


@pytest.mark.parametrize("layers, pp, vpp, reason", [
    ([2, 0], 2, True, "virtual pipeline stages"),
    ([1, 1], 2, False, r"whole ViT on stage 0 .* got \[1, 1\]"),
    ([2], 2, False, "one entry per pipeline stage"),
])
def test_layouts_the_replicas_cannot_be_built_from_are_refused(layers, pp, vpp, reason):
    with pytest.raises(TransposeUnsupported, match=reason):
        check_supported(SimpleNamespace(), layers, pp, vpp=vpp, trainable=True)
