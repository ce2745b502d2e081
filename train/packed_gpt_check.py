"""A packed batch through megatron-core's ``GPTModel`` with the ``fused_attn`` patch on, against
the same samples run one by one: the check behind ``mindspeed-flow selftest``'s ``attention``
section and of ``tests/adapters/megatron/test_attention.py``.  It lives in ``train/``, the layer
above ``patches/`` (it enables the ``fused_attn`` patches itself), not in the core.

Run it in a fresh interpreter (``python -m mindspeed_flow.train.packed_gpt_check``):
the patch must be enabled before megatron is imported, and its import hook and the CPU shims
must not leak into anything else.  It prints one JSON line: the logits' shape, the largest
|packed - alone| logit difference and the largest relative parameter-gradient difference.
"""

from __future__ import annotations


def main() -> None:
    import json

    import torch
    import torch.distributed as dist
    from mindspeed_flow.patching import PatchRegistry
    from mindspeed_flow.patches import fused_attn

    registry = PatchRegistry(fused_attn.PATCHES)
    registry.enable({"fused_attn"})

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.transformer_config import TransformerConfig
    from mindspeed_flow.adapters.megatron.core import cpu_safe_config_overrides, enable_cpu_shims

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one process: no TCP store listens
    shims = enable_cpu_shims()
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0, hidden_dropout=0.0, **cpu_safe_config_overrides())
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=97, max_sequence_length=64,
                     position_embedding_type="rope")
    lengths = [5, 1, 17, 9]
    ids = [torch.randint(0, 97, (1, n)) for n in lengths]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    weights = torch.randn(1, sum(lengths), 97)

    def grads(logits):
        model.zero_grad(set_to_none=True)
        (logits * weights).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    packed_logits = model(torch.cat(ids, dim=1), positions, None, packed_seq_params=packed)
    packed_grads = grads(packed_logits)
    alone_logits = torch.cat([model(x, torch.arange(x.shape[1])[None], None) for x in ids], dim=1)
    alone_grads = grads(alone_logits)
    out = {"shape": list(packed_logits.shape),
           "logits": (packed_logits - alone_logits).abs().max().item(),
           "grads_rel": max(((packed_grads[n] - alone_grads[n]).abs().max() / alone_grads[n].abs().max()).item()
                            for n in alone_grads if alone_grads[n].abs().max() > 0)}
    parallel_state.destroy_model_parallel()
    shims.remove()
    registry.remove()
    dist.destroy_process_group()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
