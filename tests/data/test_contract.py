"""The loader's batch against what MindSpeed-MM and the ``fused_attn`` patches read.

MindSpeed-MM cannot be installed here, so the contract is checked on its pinned source
(``pinned_upstream.upstream_sources``): ``pretrain_vlm.forward_step`` calls ``model(**get_batch(...))``,
so every batch key must be a parameter of the real ``VLMModel.forward`` or fall into its
``**kwargs``.  A function with exactly that signature (read from the source) is then
driven through the real ``fused_attn`` wrappers with a loader batch: the packed path must
start (``packed_seq_params`` from the loader's ``cu_seqlens``, the per-sample M-RoPE ids
passed through, no dense mask built).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from mindspeed_flow.adapters.mindspeed_mm import model as mindspeed_mm
from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.batch import TENSOR_KEYS
from mindspeed_flow.patching.source import find_in_source

from data_corpus import demo_corpus
from pinned_upstream import upstream_sources


@pytest.fixture(scope="module")
def upstream() -> Path:
    return upstream_sources().mindspeed_mm


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    corpus = demo_corpus(tmp_path_factory, samples=30)
    loader = FlowDataLoader(corpus, None, capacity=2048, num_workers=0, window=4, max_pixels=112 * 112)
    return max(loader, key=lambda b: len(b["sample_ids"]))  # the pack with the most samples


def _vlm_forward_params(upstream: Path) -> list[tuple[str, str]]:
    hit = find_in_source("mindspeed_mm.models.vlm_model", "VLMModel.forward", [upstream])
    assert hit is not None and hit.params is not None
    return hit.params


def test_forward_step_passes_the_whole_batch_as_keyword_arguments(upstream):
    tree = ast.parse((upstream / "pretrain_vlm.py").read_text())
    forward_step = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "forward_step")
    calls = [c for c in ast.walk(forward_step) if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "model"]
    assert len(calls) == 1
    (star,) = [k for k in calls[0].keywords if k.arg is None]
    assert isinstance(star.value, ast.Call) and star.value.func.id == "get_batch"


def test_every_batch_key_is_a_vlm_forward_parameter_or_lands_in_kwargs(upstream, batch):
    params = dict(_vlm_forward_params(upstream))
    assert params.get("kwargs") == "var_keyword"  # cu_seqlens (popped by fused_attn) and sample_ids
    named = {"input_ids", "labels", "attention_mask", "position_ids", "pixel_values", "image_grid_thw"}
    assert named <= set(params) and set(TENSOR_KEYS) - named == {"cu_seqlens"}
    assert set(batch) == set(TENSOR_KEYS) | {"sample_ids"}


def _function_with_signature(params: list[tuple[str, str]], body):
    """``def forward(self, <upstream's parameters>)`` calling ``body(**bound arguments)``."""
    parts = []
    for name, kind in params:
        parts.append({"var_positional": f"*{name}", "var_keyword": f"**{name}"}.get(
            kind, name if name in ("self", "input_ids") else f"{name}=None"))
    namespace = {"_body": body}
    exec(f"def forward({', '.join(parts)}):\n    return _body(**{{k: v for k, v in locals().items()}})", namespace)
    return namespace["forward"]


def test_a_loader_batch_takes_the_packed_path_through_the_fused_attn_wrappers(upstream, batch):
    pytest.importorskip("megatron.core")
    seen = {}

    def dense_mask_builder(*args, **kwargs):
        raise AssertionError("the dense [B, 1, S, S] LLM mask was built for a packed batch")

    def body(self, **arguments):
        seen.update(arguments)
        mask, position_ids = mindspeed_mm.prepare_mask_for_llm(
            dense_mask_builder, None, (),
            {"config": None, "input_ids": arguments["input_ids"], "inference_params": None,
             "attention_mask": arguments["attention_mask"], "position_ids": arguments["position_ids"]})
        seen["mask"], seen["llm_position_ids"] = mask, position_ids
        return "logits"

    forward = _function_with_signature(_vlm_forward_params(upstream), body)
    # pretrain_vlm.get_batch casts floats to the params dtype and adds 'tranfer'
    kwargs = {k: (v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v)
              for k, v in batch.items()}
    kwargs["tranfer"] = None
    assert mindspeed_mm.vlm_forward(lambda *a, **k: forward(None, *a, **k), None, (), kwargs) == "logits"

    packed = seen["packed_seq_params"]
    assert packed is not None and packed.qkv_format == "thd"
    assert torch.equal(packed.cu_seqlens_q, batch["cu_seqlens"]) and packed.cu_seqlens_q.dtype == torch.int32
    lengths = batch["cu_seqlens"].diff()
    assert packed.max_seqlen_q == int(lengths.max()) and len(lengths) >= 2
    assert "cu_seqlens" not in seen["kwargs"] and set(seen["kwargs"]) == {"sample_ids", "tranfer"}
    assert seen["mask"] is None and seen["llm_position_ids"] is batch["position_ids"]
    assert torch.equal(seen["pixel_values"], batch["pixel_values"].to(torch.bfloat16))
