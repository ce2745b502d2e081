"""Test 4: MindSpeed's patch manager and ours on ``DotProductAttention.forward`` in real runs.

MindSpeed's features wrap or replace ``DotProductAttention.forward`` at adaptor import
(``GenerateMaskFeature``'s wrapper by default; the flash-attention replacement under
``--use-flash-attn``), around whatever ``getattr(cls, "forward")`` gives, which with the plugin
is our wrapt wrapper's bound form.  After the training step the chain must hold our wrapper
exactly once, and after ``registry.remove()`` it must be layer for layer the chain of the
same run without the plugin: ours gone, MindSpeed's layers kept, the same innermost function.
"""

from __future__ import annotations

import pytest



def ours_in(layers: list[str]) -> int:
    return sum(layer.startswith("wrapt ") and "adapters/megatron/attention.py:dot_product_attention_forward" in layer
               for layer in layers)


@pytest.mark.parametrize("pair", [("bf16_plain", "bf16_flow"), ("fp32_plain", "fp32_flow")],
                         ids=["default-attention", "use-flash-attn"])
def test_our_wrapper_sits_once_and_remove_restores_upstreams_chain(runs, pair):
    plain, ours = (runs.get(name) for name in pair)
    upstream_chain = plain.result["attention_chain"]
    assert ours_in(upstream_chain["layers"]) == 0
    assert len(upstream_chain["layers"]) >= 2, "MindSpeed wrapped nothing: the test would prove nothing"
    assert ours_in(ours.result["attention_chain"]["layers"]) == 1, ours.result["attention_chain"]
    assert ours.result["attention_chain_after_remove"] == upstream_chain
