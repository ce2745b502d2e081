"""varlen_attention against the dense-mask reference, and the kernels' argument translation.

The reference is textbook masked softmax attention on a dense ``[T, T]`` segment mask, in
the same dtype (fp32); the varlen result must match within 1e-5 on random packs (single
token segments, one segment filling the pack, causal and bidirectional, sliding windows,
GQA, unequal query/key lengths) and on Qwen2.5-VL window segments.  A dispatch-mode
recorder checks that no tensor of the pack's ``[T, T]`` footprint is built, forward or
backward.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from mindspeed_flow.adapters.devices import flash_attn as flash_adapter
from mindspeed_flow.adapters.devices import torch_npu as npu_adapter
from mindspeed_flow.adapters.devices.flash_attn import flash_varlen_args
from mindspeed_flow.adapters.devices.torch_npu import COMPRESSED_MASK_SIZE, UNBOUNDED, compressed_mask, npu_fusion_attention_args
from mindspeed_flow.attention import VarlenBackend, select_backend, varlen_attention
from mindspeed_flow.attention import backends as backends_module
from mindspeed_flow.attention import sdpa as sdpa_module
from mindspeed_flow.attention.reference import dense_attention, segment_mask
from mindspeed_flow.attention.segments import offsets

TOL = 1e-5


def cu_of(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def random_qkv(tq: int, tk: int, heads: int, kv_heads: int, dim: int, seed: int, grad: bool = False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tq, heads, dim, generator=gen)
    k = torch.randn(tk, kv_heads, dim, generator=gen)
    v = torch.randn(tk, kv_heads, dim, generator=gen)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def check_against_dense(lq, lk, causal, window, heads=4, kv_heads=2, dim=16, seed=0):
    cu_q, cu_k = cu_of(lq), cu_of(lk)
    q, k, v = random_qkv(cu_q[-1], cu_k[-1], heads, kv_heads, dim, seed)
    got = varlen_attention(q, k, v, cu_q, cu_k, causal, window=window)
    mask = segment_mask(cu_q, cu_k, cu_q[-1], cu_k[-1], causal, window)
    ref = dense_attention(q, k, v, mask, 1 / math.sqrt(dim))
    assert got.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


windows = st.one_of(st.none(), st.tuples(st.integers(-1, 6), st.integers(-1, 6)))


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=8), causal=st.booleans(),
       window=windows, seed=st.integers(0, 2**16))
def test_random_packs_match_dense_reference(lengths, causal, window, seed):
    check_against_dense(lengths, lengths, causal, window, seed=seed)


@settings(max_examples=30, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=6),
       causal=st.booleans(), window=windows)
def test_unequal_query_and_key_lengths_align_bottom_right(pairs, causal, window):
    lq, lk = [a for a, _ in pairs], [b for _, b in pairs]
    if sum(lq) == 0:
        lq[0] = 1
    check_against_dense(lq, lk, causal, window)


@pytest.mark.parametrize("causal", [True, False])
def test_single_token_segments_and_one_segment_filling_the_pack(causal):
    check_against_dense([1] * 37, [1] * 37, causal, None)
    check_against_dense([300], [300], causal, None)
    check_against_dense([1, 298, 1], [1, 298, 1], causal, (5, 3))


def test_windows_longer_than_a_query_block(monkeypatch):
    # shrink the block so the blocked (windowed) path crosses several blocks on a small pack
    monkeypatch.setattr(sdpa_module, "BLOCK", 16)
    for causal in (True, False):
        check_against_dense([70, 3, 45], [70, 3, 45], causal, (20, 9))
        check_against_dense([70, 3], [90, 1], causal, None)


class TensorShapes(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for item in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(item, torch.Tensor):
                self.shapes.append((str(func), tuple(item.shape)))
        return out


@pytest.mark.parametrize(
    "lengths, causal, window",
    [
        ([700, 1, 1200, 99, 1000], True, None),   # LLM pack: causal segments
        ([700, 1, 1200, 99, 1000], False, None),  # ViT pack: full segments
        ([3000], True, (256, 0)),                 # one segment filling the pack, sliding window
        ([3000], False, (-1, 8)),                 # ... window unbounded on one side
        ([1500, 1500], False, (100, 100)),
    ],
)
def test_no_pack_sized_tensor_is_ever_built(lengths, causal, window):
    """Neither forward nor backward allocates anything with a [T, T] footprint: every tensor
    any aten op returns has the product of any two of its dimensions below T * T (a dense
    mask or score matrix of the pack would reach it)."""
    cu = cu_of(lengths)
    total = cu[-1]
    q, k, v = random_qkv(total, total, 4, 2, 8, seed=6, grad=True)
    with TensorShapes() as seen:
        varlen_attention(q, k, v, cu, cu, causal, window=window).sum().backward()
    assert seen.shapes  # the mode saw the ops
    offenders = [(op, shape) for op, shape in seen.shapes
                 if any(a * b >= total * total for a, b in itertools.combinations(shape, 2))]
    assert offenders == []
    # the check has teeth: the dense reference trips it
    with TensorShapes() as dense:
        segment_mask(cu, cu, total, total, causal, window)
    assert any(shape == (total, total) for _, shape in dense.shapes)


def qwen25_window_lengths(grid_thw, window_patches=112, patch=14, merge=2):
    """Segment lengths of Qwen2.5-VL's windowed ViT layers: each image's merged-patch grid
    is cut into windows of (window_patches / patch / merge)^2 merged patches, edge windows
    smaller; each merged patch is merge^2 tokens."""
    side = window_patches // patch // merge
    out = []
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        for _ in range(t):
            for r in range(0, gh, side):
                for c in range(0, gw, side):
                    out.append(min(side, gh - r) * min(side, gw - c) * merge * merge)
    return out


def test_qwen25_vl_window_attention_segments():
    lengths = qwen25_window_lengths([(1, 20, 28), (2, 8, 12), (1, 6, 6)])
    assert len(set(lengths)) > 1  # full and edge windows
    check_against_dense(lengths, lengths, False, None, heads=4, kv_heads=4)
    full = [t * h * w for t, h, w in [(1, 20, 28), (2, 8, 12), (1, 6, 6)]]
    check_against_dense(full, full, False, None, heads=4, kv_heads=4)


def test_backward_matches_dense_reference():
    lengths = [1, 9, 1, 30, 4]
    cu = cu_of(lengths)
    for causal, window in [(True, None), (False, None), (True, (4, -1)), (False, (3, 2))]:
        q, k, v = random_qkv(cu[-1], cu[-1], 4, 2, 8, seed=1, grad=True)
        qr, kr, vr = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        grad = torch.randn(cu[-1], 4, 8, generator=torch.Generator().manual_seed(2))
        varlen_attention(q, k, v, cu, cu, causal, window=window).backward(grad)
        mask = segment_mask(cu, cu, cu[-1], cu[-1], causal, window)
        dense_attention(qr, kr, vr, mask, 1 / math.sqrt(8)).backward(grad)
        for a, b in ((q, qr), (k, kr), (v, vr)):
            torch.testing.assert_close(a.grad, b.grad, atol=TOL, rtol=0)


def test_rows_with_no_key_are_zero_with_finite_gradients():
    # causal, 4 queries against 2 keys: the first two queries see nothing (bottom-right)
    q, k, v = random_qkv(4, 2, 2, 2, 8, seed=3, grad=True)
    out = varlen_attention(q, k, v, [0, 4], [0, 2], causal=True)
    assert torch.equal(out[:2], torch.zeros_like(out[:2]))
    out.sum().backward()
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def test_leading_zero_is_optional_and_tensors_are_accepted():
    q, k, v = random_qkv(10, 10, 2, 2, 4, seed=4)
    a = varlen_attention(q, k, v, torch.tensor([0, 3, 10], dtype=torch.int32), [3, 10], True)
    b = varlen_attention(q, k, v, [3, 10], torch.tensor([0, 3, 10]), True)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda q, k, v: varlen_attention(q, k, v, [0, 4], [0, 10], True), "segments must cover"),
        (lambda q, k, v: varlen_attention(q, k, v, [0, 6, 4, 10], [0, 6, 4, 10], True), "non-decreasing"),
        (lambda q, k, v: varlen_attention(q, k, v, [0, 5, 10], [0, 10], True), "segments but"),
        (lambda q, k, v: varlen_attention(q[None], k, v, [0, 10], [0, 10], True), "TND"),
        (lambda q, k, v: varlen_attention(q, k[:, :1].expand(10, 3, 4), v, [0, 10], [0, 10], True), "fit"),
        (lambda q, k, v: varlen_attention(q, k, v, [0, 10], [0, 10], True, window=(-2, 0)), ">= -1"),
        (lambda q, k, v: varlen_attention(q, k, v, [0, 10], [0, 10], True, backend="nope"), "unknown"),
        (lambda q, k, v: varlen_attention(q, k, v, [0, 10], [0, 10], True, backend="npu"), "torch_npu"),
    ],
)
def test_clear_errors(call, message):
    q, k, v = random_qkv(10, 10, 2, 2, 4, seed=5)
    with pytest.raises((ValueError, RuntimeError), match=message):
        call(q, k, v)


def test_backend_selection_falls_back_to_sdpa_without_device_kernels():
    assert select_backend("cpu").name == "sdpa"
    assert select_backend("cuda").name == "sdpa"  # flash-attn absent here: degrade, not fail
    with pytest.raises(RuntimeError, match="flash-attn"):
        select_backend("cuda", "flash_attn")


def test_a_kernel_that_does_not_take_the_dtype_yields_to_the_fallback(monkeypatch):
    # Stand-in for flash-attn on a CUDA host (neither exists here): runnable, bf16/fp16 only.
    stand_in = VarlenBackend(name="half_only", device_types=("cuda",), fn=lambda *a: None,
                             dtypes=(torch.float16, torch.bfloat16))
    monkeypatch.setitem(backends_module._BACKENDS, "half_only", stand_in)
    assert select_backend("cuda", dtype=torch.bfloat16) is stand_in
    assert select_backend("cuda", dtype=torch.float32).name == "sdpa"
    with pytest.raises(RuntimeError, match="not torch.float32"):
        select_backend("cuda", "half_only", torch.float32)
    assert backends_module._BACKENDS["flash_attn"].dtypes == (torch.float16, torch.bfloat16)


@pytest.mark.parametrize("adapter, kernel, library, device",
                         [(npu_adapter, npu_adapter.npu_varlen, "torch_npu", "npu"),
                          (flash_adapter, flash_adapter.flash_varlen, "flash-attn", "cuda")])
def test_device_kernels_called_directly_name_what_is_missing(monkeypatch, adapter, kernel, library, device):
    q, k, v = random_qkv(4, 4, 2, 2, 4, seed=7)
    call = (q, k, v, [0, 4], [0, 4], True, 0.5, (-1, 0), 0.0)
    with pytest.raises(RuntimeError, match=f"unavailable: {library}"):
        kernel(*call)
    # Stand-in for an installed library (neither can be installed here): CPU tensors are
    # then refused by name, before the kernel's module is imported.
    monkeypatch.setattr(adapter, "missing", lambda: None)
    with pytest.raises(RuntimeError, match=f"needs tensors on a {device} device, got device cpu"):
        kernel(*call)


# --- argument translation of the device kernels (pure functions; the kernels cannot run here)

def test_npu_args_causal_uses_compressed_mask_and_cumulative_ends():
    offs = offsets([2, 4, 6], 6)
    args = npu_fusion_attention_args(offs, offs, 8, 0.125, (-1, 0), 0.1)
    assert args["input_layout"] == "TND" and args["head_num"] == 8
    assert args["actual_seq_qlen"] == [2, 4, 6] == args["actual_seq_kvlen"]
    assert args["sparse_mode"] == 3 and args["atten_mask"] == "compressed"
    assert args["keep_prob"] == pytest.approx(0.9) and args["scale"] == 0.125


def test_npu_args_full_and_band():
    offs = [0, 5, 9]
    full = npu_fusion_attention_args(offs, offs, 2, 1.0, (-1, -1), 0.0)
    assert full["sparse_mode"] == 0 and full["atten_mask"] is None
    assert full["pre_tockens"] == full["next_tockens"] == UNBOUNDED
    band = npu_fusion_attention_args(offs, offs, 2, 1.0, (64, 0), 0.0)
    assert (band["sparse_mode"], band["pre_tockens"], band["next_tockens"]) == (4, 64, 0)
    wide = npu_fusion_attention_args(offs, offs, 2, 1.0, (-1, 3), 0.0)
    assert (wide["sparse_mode"], wide["pre_tockens"], wide["next_tockens"]) == (4, UNBOUNDED, 3)


def test_npu_compressed_mask_is_upper_triangular_2048():
    mask = compressed_mask(torch.device("cpu"))
    assert mask.shape == (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE) and mask.dtype == torch.bool
    assert not mask[5, 5] and mask[5, 6] and not mask[6, 5]


def test_flash_attn_args():
    args = flash_varlen_args([0, 3, 10, 11], [0, 3, 10, 11], True, 0.5, (16, 0), 0.0)
    assert args["cu_seqlens_q"].dtype == torch.int32
    assert args["cu_seqlens_q"].tolist() == [0, 3, 10, 11]
    assert (args["max_seqlen_q"], args["max_seqlen_k"]) == (7, 7)
    assert args["causal"] is True and args["window_size"] == (16, 0) and args["softmax_scale"] == 0.5
