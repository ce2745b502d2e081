"""Plain-torch reference versions of the torch_npu kernels the CPU harness path calls.

Each follows the documented semantics of the Ascend kernel (torch_npu API reference,
"torch_npu.npu_fusion_attention", "npu_rms_norm", "npu_rotary_mul", "npu_swiglu"):
accumulate in fp32, return in the input dtype.  Modes the harness path does not reach
raise ``NotImplementedError`` naming the mode instead of guessing.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from ._record import stood_in

UNBOUNDED = 2147483647  # the kernel's default pre_tockens / next_tockens


@stood_in("npu_rms_norm")
def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6):
    """``(x * rsqrt(mean(x^2, -1) + eps) * gamma, rstd)``; rstd keeps the reduced dims."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


@stood_in("npu_swiglu")
def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``silu(a) * b`` for ``a, b = x.chunk(2, dim)``."""
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


@stood_in("npu_rotary_mul")
def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    """``x * cos + rotate(x) * sin``; ``half``: rotate = cat(-x2, x1) of the two halves,
    ``interleave``: pairs (x0, x1) -> (-x1, x0)."""
    xf = x.float()
    if rotary_mode == "half":
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    elif rotary_mode == "interleave":
        pairs = xf.unflatten(-1, (-1, 2))
        rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    else:
        raise NotImplementedError(f"npu_rotary_mul stand-in: rotary_mode={rotary_mode!r}")
    return (xf * r1.float() + rotated * r2.float()).to(x.dtype)


def _visible(sq: int, skv: int, atten_mask: Optional[torch.Tensor], sparse_mode: int,
             pre_tockens: int, next_tockens: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[.., sq, skv]``: True where query i may attend key j.

    mode 0 (defaultMask): without a mask nothing is masked and pre/next_tockens are
    ignored; with one, the mask (True = masked) and the band
    ``i - pre_tockens <= j <= i + next_tockens``; modes 2 / 3 (left-up / right-down causal):
    causal from the top-left / bottom-right corner, the mask's content is ignored (it is
    the compressed 2048 x 2048 triangle); mode 4 (band): the band, right-down aligned.
    """
    i = torch.arange(sq, device=device).unsqueeze(1)
    j = torch.arange(skv, device=device).unsqueeze(0)
    if sparse_mode == 0:
        if atten_mask is None:
            return torch.ones(sq, skv, dtype=torch.bool, device=device)
        mask = atten_mask.to(torch.bool)
        if mask.shape[-2:] != (sq, skv):
            raise ValueError(f"npu_fusion_attention stand-in: atten_mask {tuple(mask.shape)} "
                             f"does not end in ({sq}, {skv}) under sparse_mode 0")
        return (j >= i - pre_tockens) & (j <= i + next_tockens) & ~mask
    shift = skv - sq  # right-down alignment
    if sparse_mode == 2:
        return j <= i
    if sparse_mode == 3:
        return j <= i + shift
    if sparse_mode == 4:
        return (j >= i + shift - pre_tockens) & (j <= i + shift + next_tockens)
    raise NotImplementedError(f"npu_fusion_attention stand-in: sparse_mode={sparse_mode}")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
            scale: float, keep_prob: float) -> torch.Tensor:
    """Softmax attention on ``[B, N, S, D]`` in fp32; grouped K/V heads are repeated."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a fully masked row attends nothing
    if keep_prob < 1.0:
        probs = F.dropout(probs, p=1.0 - keep_prob)
    return torch.matmul(probs, v.float()).to(q.dtype)


def _to_bnsd(x: torch.Tensor, layout: str, heads: Optional[int]) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        return x.unflatten(-1, (heads, -1)).transpose(1, 2)
    if layout == "SBH":
        return x.unflatten(-1, (heads, -1)).permute(1, 2, 0, 3)
    raise NotImplementedError(f"npu_fusion_attention stand-in: input_layout={layout!r}")


def _from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(1, 2)
    if layout == "BSH":
        return x.transpose(1, 2).flatten(-2)
    return x.permute(2, 0, 1, 3).flatten(-2)  # SBH


@stood_in("npu_fusion_attention")
def npu_fusion_attention(query, key, value, head_num: int, input_layout: str, pse=None, padding_mask=None,
                         atten_mask=None, scale: float = 1.0, keep_prob: float = 1.0,
                         pre_tockens: int = UNBOUNDED, next_tockens: int = UNBOUNDED, inner_precise: int = 0,
                         prefix=None, actual_seq_qlen: Optional[Sequence[int]] = None,
                         actual_seq_kvlen: Optional[Sequence[int]] = None, sparse_mode: int = 0,
                         gen_mask_parallel: bool = True, sync: bool = False):
    """``softmax(mask(scale * Q K^T)) V`` with the kernel's layouts and sparse modes.

    TND: ``actual_seq_qlen`` / ``actual_seq_kvlen`` are cumulative segment ends without a
    leading zero; attention stays inside each segment.  Returns the kernel's 7-tuple; only
    the output is computed, the softmax statistics are empty tensors and seed/offset/numels 0.
    """
    if pse is not None or prefix is not None:
        raise NotImplementedError("npu_fusion_attention stand-in: pse / prefix")
    if input_layout == "TND":
        if actual_seq_qlen is None or actual_seq_kvlen is None:
            raise ValueError("npu_fusion_attention: TND needs actual_seq_qlen and actual_seq_kvlen")
        if atten_mask is not None and sparse_mode == 0:
            raise NotImplementedError("npu_fusion_attention stand-in: TND with a sparse_mode 0 atten_mask")
        outs = []
        q_start = kv_start = 0
        for q_end, kv_end in zip(list(actual_seq_qlen), list(actual_seq_kvlen)):
            q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in
                       (query[q_start:q_end], key[kv_start:kv_end], value[kv_start:kv_end]))
            keep = _visible(q_end - q_start, kv_end - kv_start, None, sparse_mode, pre_tockens,
                            next_tockens, query.device)
            outs.append(_attend(q, k, v, keep, scale, keep_prob).squeeze(0).transpose(0, 1))
            q_start, kv_start = q_end, kv_end
        out = torch.cat(outs, dim=0)
    else:
        kv_heads = None
        if input_layout in ("BSH", "SBH"):
            head_dim = query.shape[-1] // head_num
            kv_heads = key.shape[-1] // head_dim
        q = _to_bnsd(query, input_layout, head_num)
        k = _to_bnsd(key, input_layout, kv_heads)
        v = _to_bnsd(value, input_layout, kv_heads)
        keep = _visible(q.shape[2], k.shape[2], atten_mask, sparse_mode, pre_tockens, next_tockens, query.device)
        out = _from_bnsd(_attend(q, k, v, keep, scale, keep_prob), input_layout)
    empty = query.new_empty(0, dtype=torch.float32)
    return out, empty, empty, empty, 0, 0, 0


__all__ = ["npu_rms_norm", "npu_swiglu", "npu_rotary_mul", "npu_fusion_attention", "UNBOUNDED"]
