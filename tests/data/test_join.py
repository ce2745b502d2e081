"""The pack join: :func:`normalize_joined` (each sample normalised straight into the pack's
float32 buffer, no uint8 concatenation first) is bit for bit ``normalize(torch.cat(parts))``.
The join threads' order and resume are covered by test_resume.py and test_loader.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mindspeed_flow.data.images import normalize, normalize_joined


@pytest.mark.parametrize("rows", [[0], [3, 0, 5], [17, 1, 0, 40]])
def test_normalize_joined_equals_normalize_of_the_concatenation(rows):
    rng = np.random.default_rng(len(rows))
    parts = [torch.from_numpy(rng.integers(0, 256, (n, 1176), dtype=np.uint8)) for n in rows]
    joined = normalize_joined(parts)
    assert joined.dtype == torch.float32 and joined.shape == (sum(rows), 1176)
    assert torch.equal(joined, normalize(torch.cat(parts)))
