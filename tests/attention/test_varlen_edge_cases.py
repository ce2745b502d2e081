"""varlen_attention at the edges: an empty pack, and dropout on CPU.

An empty pack (``cu_seqlens=[0]``, no tokens) is a legal input, e.g. a pipeline stage's
microbatch that holds no image: it gives an empty result and an empty gradient, not a
``torch.cat`` error.  With ``dropout_p > 0`` PyTorch's CPU SDPA has no fused kernel, so a
whole-segment call would build ``[H, L, L]`` scores; the SDPA backend must keep every
tensor, forward and backward, below one segment's square, and its per-block
recomputation must replay the very dropout mask of the forward pass.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from mindspeed_flow.attention import sdpa as sdpa_module
from mindspeed_flow.attention import varlen_attention
from mindspeed_flow.attention.segments import normalize_window

from tests.attention.test_varlen import TensorShapes, cu_of, random_qkv


@pytest.mark.parametrize("cu_q, cu_k, tq, tk", [
    ([0], [0], 0, 0),            # no segment at all
    ([0, 0, 0], [0, 0, 0], 0, 0),  # segments of no token
    ([0, 3], [0, 0], 3, 0),      # queries but no key: every row sees nothing -> 0
])
@pytest.mark.parametrize("causal", [True, False])
def test_empty_pack_gives_an_empty_result_and_gradients(cu_q, cu_k, tq, tk, causal):
    q, k, v = random_qkv(tq, tk, 4, 2, 8, seed=0, grad=True)
    out = varlen_attention(q, k, v, cu_q, cu_k, causal)
    assert out.shape == (tq, 4, 8)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()


def segment_square_offenders(shapes, length):
    """Ops that returned a tensor with two dimensions spanning a segment's [L, L] square."""
    return [(op, shape) for op, shape in shapes
            if any(a * b >= length * length for a, b in itertools.combinations(shape, 2))]


@pytest.mark.parametrize("causal, window", [(True, None), (False, None), (True, (40, 0))])
def test_dropout_on_cpu_never_builds_a_segment_sized_score_matrix(monkeypatch, causal, window):
    monkeypatch.setattr(sdpa_module, "BLOCK", 64)
    length = 256
    q, k, v = random_qkv(length + 7, length + 7, 4, 2, 8, seed=1, grad=True)
    cu = cu_of([length, 7])
    torch.manual_seed(0)
    with TensorShapes() as seen:
        varlen_attention(q, k, v, cu, cu, causal, window=window, dropout_p=0.1).sum().backward()
    assert seen.shapes
    assert segment_square_offenders(seen.shapes, length) == []
    # the check has teeth: SDPA on the whole segment with dropout takes the math kernel
    with TensorShapes() as whole:
        F.scaled_dot_product_attention(q[:length].transpose(0, 1), k[:length].transpose(0, 1).repeat(2, 1, 1),
                                       v[:length].transpose(0, 1).repeat(2, 1, 1), dropout_p=0.1,
                                       is_causal=causal)
    assert any(shape[-2:] == (length, length) for _, shape in segment_square_offenders(whole.shapes, length))


def test_dropout_recomputation_replays_the_forward_mask(monkeypatch):
    """Gradients through the checkpointed blocks equal those of the same blocks kept in
    memory under the same seed: the backward pass saw the forward pass's dropout mask
    (a fresh mask would give other gradients, which the last assertion shows)."""
    monkeypatch.setattr(sdpa_module, "BLOCK", 32)
    length, heads, dim, p = 100, 4, 8, 0.3
    q, k, v = random_qkv(length, length, heads, heads, dim, seed=2, grad=True)
    grad_out = torch.randn(length, heads, dim, generator=torch.Generator().manual_seed(3))
    window, scale = normalize_window(None, True), 1 / math.sqrt(dim)

    torch.manual_seed(11)
    out = varlen_attention(q, k, v, [0, length], [0, length], True, dropout_p=p)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)

    qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    qb, kb, vb = (x.transpose(0, 1)[None] for x in (qr, kr, vr))
    torch.manual_seed(11)
    blocks = [sdpa_module._attend_block(qb, kb, vb, r0, min(r0 + 32, length), window, scale, p, False)
              for r0 in range(0, length, 32)]
    ref = torch.cat(blocks, dim=-2)[0].transpose(0, 1)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), grad_out)

    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.manual_seed(12)  # another mask: other output, so the equality above is not vacuous
    assert not torch.allclose(varlen_attention(q, k, v, [0, length], [0, length], True, dropout_p=p), out)


def test_dropout_keeps_the_expected_value():
    """Inverted dropout: averaged over many draws the output tends to the dropout-free one."""
    q, k, v = random_qkv(40, 40, 2, 2, 8, seed=4)
    exact = varlen_attention(q, k, v, [0, 25, 40], [0, 25, 40], False)
    torch.manual_seed(5)
    draws = torch.stack([varlen_attention(q, k, v, [0, 25, 40], [0, 25, 40], False, dropout_p=0.2)
                         for _ in range(200)])
    assert not torch.allclose(draws[0], exact, atol=1e-3)
    assert (draws.mean(0) - exact).abs().max() < 0.1 * exact.abs().max()
