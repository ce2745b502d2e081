"""The ``fused_attn`` patch on the real megatron-core ``DotProductAttention`` and ``GPTModel``, on CPU.

In a fresh interpreter (the registry's import hook and the CPU shims must not leak into
other tests): enable the feature before megatron is imported, build the module, call
forward with ``packed_seq_params`` (THD) and compare with Megatron's own dense path on the
same tensors with the equivalent dense block mask; also forward+backward, GQA, the ViT's
list-without-leading-zero convention, a mask type segments cannot express, and undo.
"""

from __future__ import annotations

from subprocess_utils import last_json, run_python

GPT_SCRIPT = "from mindspeed_flow.train.packed_gpt_check import main; main()"  # what the self-test runs

SCRIPT = r'''
import json
import torch
import torch.distributed as dist
from mindspeed_flow.patching import PatchRegistry
from mindspeed_flow.patches import fused_attn

registry = PatchRegistry(fused_attn.PATCHES)
registry.enable({"fused_attn"})

from mindspeed_flow.adapters.megatron.core import enable_cpu_shims
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig
from mindspeed_flow.attention.reference import segment_mask

shims = enable_cpu_shims()
# A real one-rank group and model-parallel state, not just a TP world size of 1:
# megatron-core 0.16 builds DotProductAttention's process groups from parallel_state
# (pg_collection.tp.size()), which is None unless initialize_model_parallel() ran.
# HashStore: one rank needs no rendezvous port. 0.12 is built the same way.
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
parallel_state.initialize_model_parallel()
out = {"status": [r.status for r in registry.report()][:1]}

def module(mask_type, groups, **extra):
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                               attention_dropout=0.0, hidden_dropout=0.0, masked_softmax_fusion=False, **extra)
    return DotProductAttention(config, layer_number=1, attn_mask_type=mask_type, attention_type="self")

torch.manual_seed(0)
lens = [1, 7, 1, 23, 12]
T = sum(lens)
cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                         max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
diffs = {}
for name, mask_type, causal, groups in [("causal", AttnMaskType.causal, True, 4),
                                        ("causal_gqa", AttnMaskType.causal, True, 2),
                                        ("vit_no_mask", AttnMaskType.no_mask, False, 4)]:
    attn = module(mask_type, groups)
    q = torch.randn(T, 4, 16, requires_grad=True)
    k = torch.randn(T, groups, 16, requires_grad=True)
    v = torch.randn(T, groups, 16, requires_grad=True)
    cu_arg = packed if name != "vit_no_mask" else PackedSeqParams(cu_seqlens_q=cu[1:].tolist(),
                                                                  cu_seqlens_kv=cu[1:].tolist())
    got = attn(q, k, v, None, packed_seq_params=cu_arg)             # [T, 1, 64]
    # Megatron's dense path: [S, B, H, D], mask True = masked, [1, 1, S, S]
    blocked = ~segment_mask(cu, cu, T, T, causal)[None, None]
    qd, kd, vd = (x.detach().clone().unsqueeze(1).requires_grad_(True) for x in (q, k, v))
    ref = attn(qd, kd, vd, blocked)                                  # [T, 1, 64]
    grad = torch.randn_like(ref)
    got.backward(grad)
    ref.backward(grad)
    diffs[name] = {
        "shape": list(got.shape),
        "fwd": (got - ref).abs().max().item(),
        "dq": (q.grad - qd.grad.squeeze(1)).abs().max().item(),
        "dk": (k.grad - kd.grad.squeeze(1)).abs().max().item(),
        "dv": (v.grad - vd.grad.squeeze(1)).abs().max().item(),
    }
out["diffs"] = diffs

try:
    module(AttnMaskType.arbitrary, 4)(torch.randn(T, 4, 16), torch.randn(T, 4, 16), torch.randn(T, 4, 16),
                                      None, packed_seq_params=packed)
    out["arbitrary"] = None
except ValueError as err:
    out["arbitrary"] = str(err)

# megatron-core 0.16's local DotProductAttention also does sliding windows and softmax
# offsets (0.12's has neither): the patch must refuse them, not ignore them.
extras = {}
if "softmax_type" in TransformerConfig.__dataclass_fields__:
    extras["softmax_offset"] = {"softmax_type": "off-by-one"}
    extras["window"] = {"window_size": (8, 0)}
out["refused"] = {}
for name, extra in extras.items():
    try:
        module(AttnMaskType.causal, 4, **extra)(torch.randn(T, 4, 16), torch.randn(T, 4, 16),
                                                torch.randn(T, 4, 16), None, packed_seq_params=packed)
        out["refused"][name] = None
    except ValueError as err:
        out["refused"][name] = str(err)

registry.remove()
try:
    module(AttnMaskType.causal, 4)(torch.randn(T, 4, 16), torch.randn(T, 4, 16), torch.randn(T, 4, 16),
                                   None, packed_seq_params=packed)
    out["after_remove"] = "accepted"
except AssertionError as err:
    out["after_remove"] = "upstream refuses packed_seq_params"
parallel_state.destroy_model_parallel()
shims.remove()
dist.destroy_process_group()
print(json.dumps(out))
'''


def test_dot_product_attention_packed_matches_megatron_dense_path():
    out = last_json(run_python(SCRIPT))
    assert out["status"] == ["applied"]
    for name, d in out["diffs"].items():
        assert d["shape"] == [sum([1, 7, 1, 23, 12]), 1, 64], name
        for what in ("fwd", "dq", "dk", "dv"):
            assert d[what] < 1e-5, (name, what, d)
    assert "arbitrary" in out["arbitrary"] and "segment" in out["arbitrary"]
    for name, err in out["refused"].items():  # empty before megatron-core 0.16
        assert err is not None and err.startswith("fused_attn:"), (name, err)
    assert out["after_remove"] == "upstream refuses packed_seq_params"


def test_gpt_model_on_a_packed_batch_equals_each_sample_alone():
    """A real megatron GPTModel (local spec, RoPE, GQA) fed one THD pack gives the logits
    and parameter gradients of its samples run one by one: segments do not see each other
    and RoPE restarts per segment."""
    out = last_json(run_python(GPT_SCRIPT))
    assert out["shape"] == [1, 32, 97]
    assert out["logits"] < 1e-5 and out["grads_rel"] < 1e-5, out
