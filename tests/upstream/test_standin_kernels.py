"""The torch_npu stand-in's kernels against independent references (the equivalence tests
compare the plugin with upstream running on them, so their semantics must be the
documented ones).

The stand-in is imported in a child process: it renames torch's PrivateUse1 backend, which
must not leak into the test process.  References: torch's SDPA (with explicit masks) for
``npu_fusion_attention``; the documented rules checked are the layouts (SBH with grouped
K/V heads, TND with cumulative ``actual_seq_qlen`` without a leading zero), ``atten_mask``
True = masked, sparse_mode 0 without a mask ignoring ``pre_tockens`` / ``next_tockens``,
sparse_mode 3 as causal per segment, and rotate-half for ``npu_rotary_mul``.
"""

from __future__ import annotations

from subprocess_utils import last_json, run_python
from harness import STANDINS

CHECKS = """
    import json
    import torch
    import torch.nn.functional as F
    import torch_npu

    torch.manual_seed(0)
    out = {}

    # SBH, 4 query heads over 2 K/V heads, causal bool mask [1, 1, S, S] (True = masked).
    S, B, H, KV, D = 7, 2, 4, 2, 8
    q, k, v = torch.randn(S, B, H * D), torch.randn(S, B, KV * D), torch.randn(S, B, KV * D)
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)[None, None]
    got = torch_npu.npu_fusion_attention(q, k, v, H, "SBH", atten_mask=mask, scale=D ** -0.5,
                                         pre_tockens=65536, next_tockens=0, sparse_mode=0)[0]
    qh = q.view(S, B, H, D).permute(1, 2, 0, 3)
    kh = k.view(S, B, KV, D).permute(1, 2, 0, 3).repeat_interleave(H // KV, 1)
    vh = v.view(S, B, KV, D).permute(1, 2, 0, 3).repeat_interleave(H // KV, 1)
    ref = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=~mask, scale=D ** -0.5)
    out["sbh_causal_gqa"] = float((got - ref.permute(2, 0, 1, 3).reshape(S, B, H * D)).abs().max())

    # TND, segments of 3, 4, 5 tokens (actual_seq_qlen [3, 7, 12]); no mask, next_tockens 0.
    ends, T = [3, 7, 12], 12
    q, k, v = torch.randn(T, H, D), torch.randn(T, H, D), torch.randn(T, H, D)
    block = torch.zeros(T, T, dtype=torch.bool)
    causal = torch.zeros(T, T, dtype=torch.bool)
    start = 0
    for end in ends:
        block[start:end, start:end] = True
        causal[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        start = end

    def reference(allowed):
        r = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=allowed, scale=0.3)
        return r.transpose(0, 1)

    for mode, allowed in ((0, block), (3, causal)):
        got = torch_npu.npu_fusion_attention(q, k, v, H, "TND", scale=0.3, pre_tockens=65536, next_tockens=0,
                                             actual_seq_qlen=ends, actual_seq_kvlen=ends, sparse_mode=mode)[0]
        out[f"tnd_mode{mode}"] = float((got - reference(allowed)).abs().max())

    # Rotate-half rotary: pairs (x_i, x_{i + D/2}) turned by the angle whose cos / sin are given.
    x = torch.randn(5, 1, 2, D)
    angle = torch.randn(5, 1, 1, D // 2).repeat(1, 1, 1, 2)
    got = torch_npu.npu_rotary_mul(x, angle.cos(), angle.sin())
    z = torch.complex(x[..., : D // 2], x[..., D // 2:]) * torch.polar(torch.ones_like(angle[..., : D // 2]),
                                                                     angle[..., : D // 2])
    out["rotary_half"] = float((got - torch.cat([z.real, z.imag], -1)).abs().max())

    called = torch_npu._record.summary()["called"]
    out["called"] = called
    print(json.dumps(out))
"""


def test_standin_kernels_follow_the_documented_semantics():
    result = last_json(run_python(CHECKS, env={"PYTHONPATH": str(STANDINS)}))
    called = result.pop("called")
    assert called == {"npu_fusion_attention": 3, "npu_rotary_mul": 1}
    for check, error in result.items():
        assert error < 1e-5, f"{check}: max abs error {error:.2e}"
