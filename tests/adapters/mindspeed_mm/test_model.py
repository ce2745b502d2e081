"""The MindSpeed-MM wrappers of ``fused_attn`` on stand-ins, and the declarations against
MindSpeed-MM's source.

MindSpeed-MM cannot be installed here (its PyPI name is a placeholder), so the wrappers run
through the real registry on *stand-in* modules written to a temporary directory: they
reproduce the call structure the patches rely on (``VLMModel.forward`` asks the mask builder
it imported with ``from ... import`` for a mask, then calls the text decoder without
``packed_seq_params``), not upstream's computations.  The patch targets themselves are
checked against the source tree named by ``MINDSPEED_MM_SRC`` when it is set.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mindspeed_flow.adapters.mindspeed_mm import model as mindspeed_mm
from mindspeed_flow.patching import Patch, PatchRegistry
from mindspeed_flow.patches import conv_matmul, fused_attn

_COUNTER = itertools.count()

STAND_IN_MASK = '''
"""Stand-in for mindspeed_mm.models.vision.vlm_attentionmask_for_llm."""
import torch
BUILT = []
def prepare_positionsids_mask_for_llm(config=None, input_ids=None, inference_params=None,
                                      attention_mask=None, position_ids=None, *args, **kwargs):
    seq = input_ids.shape[1]
    BUILT.append(seq)
    mask = torch.ones(input_ids.shape[0], 1, seq, seq, dtype=torch.bool).triu(1)
    if position_ids is None:
        position_ids = torch.arange(seq).expand(3, input_ids.shape[0], seq)
    return mask, position_ids
'''

STAND_IN_VLM = '''
"""Stand-in for mindspeed_mm.models.vlm_model and .common.mm_gpt_model."""
from {mask} import prepare_positionsids_mask_for_llm

class StandInMMGPTModel:
    def __init__(self):
        self.calls = []
    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, labels=None,
                inference_params=None, packed_seq_params=None, extra_block_kwargs=None):
        self.calls.append(dict(attention_mask=attention_mask, position_ids=position_ids,
                               packed_seq_params=packed_seq_params))
        return "logits"
    __call__ = lambda self, *a, **k: self.forward(*a, **k)

class StandInVLMModel:
    def __init__(self):
        self.text_decoder = StandInMMGPTModel()
        self.seen_kwargs = None
    def forward(self, input_ids, pixel_values=None, image_grid_thw=None, attention_mask=None, labels=None,
                inference_params=None, decoder_input=None, position_ids=None, packed_seq_params=None,
                *args, **kwargs):
        self.seen_kwargs = dict(kwargs)
        attention_mask, position_ids = prepare_positionsids_mask_for_llm(
            config=None, input_ids=input_ids, inference_params=inference_params,
            attention_mask=attention_mask, position_ids=position_ids, **kwargs)
        return self.text_decoder(input_ids=input_ids, position_ids=position_ids,
                                 attention_mask=attention_mask, decoder_input=None, labels=None,
                                 inference_params=inference_params)
'''


@pytest.fixture()
def stand_in(tmp_path, monkeypatch):
    """Stand-in modules under fresh names, patched by the real registry with our wrappers."""
    n = next(_COUNTER)
    mask_name, vlm_name = f"standin_mask_{n}", f"standin_vlm_{n}"
    (tmp_path / f"{mask_name}.py").write_text(STAND_IN_MASK)
    (tmp_path / f"{vlm_name}.py").write_text(STAND_IN_VLM.format(mask=mask_name))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry = PatchRegistry([
        Patch("fused_attn", f"{vlm_name}:StandInVLMModel.forward", wrapper=mindspeed_mm.vlm_forward,
              params="self, input_ids, pixel_values, image_grid_thw, attention_mask, labels, inference_params, "
                     "decoder_input, position_ids, packed_seq_params"),
        Patch("fused_attn", f"{vlm_name}:StandInMMGPTModel.forward", wrapper=mindspeed_mm.mm_gpt_forward,
              params="self, input_ids, position_ids, attention_mask, decoder_input, labels, inference_params, "
                     "packed_seq_params"),
        Patch("fused_attn", f"{mask_name}:prepare_positionsids_mask_for_llm",
              wrapper=mindspeed_mm.prepare_mask_for_llm,
              params="config, input_ids, inference_params, attention_mask, position_ids"),
    ])
    registry.enable({"fused_attn"})
    mask_mod = __import__(mask_name)
    vlm_mod = __import__(vlm_name)
    yield SimpleNamespace(mask=mask_mod, vlm=vlm_mod, registry=registry)
    registry.remove()
    for name in (mask_name, vlm_name):
        sys.modules.pop(name, None)


def packed_batch(lengths, with_positions=True):
    total = sum(lengths)
    positions = torch.cat([torch.arange(n) for n in lengths]).expand(3, 1, total)
    batch = {"input_ids": torch.zeros(1, total, dtype=torch.long),
             "attention_mask": torch.ones(1, total, dtype=torch.long),
             "cu_seqlens": torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())}
    if with_positions:
        batch["position_ids"] = positions
    return batch


def test_loader_cu_seqlens_reach_the_decoder_and_no_dense_mask_is_built(stand_in):
    assert all(r.status == "applied" for r in stand_in.registry.report())
    model = stand_in.vlm.StandInVLMModel()
    batch = packed_batch([5, 1, 10])
    assert model.forward(**batch) == "logits"
    call = model.text_decoder.calls[-1]
    assert call["attention_mask"] is None
    assert call["position_ids"] is batch["position_ids"]
    packed = call["packed_seq_params"]
    assert packed.qkv_format == "thd" and packed.max_seqlen_q == 10
    assert packed.cu_seqlens_q.dtype == torch.int32 and packed.cu_seqlens_q.tolist() == [0, 5, 6, 16]
    assert stand_in.mask.BUILT == []  # the dense builder never ran
    assert "cu_seqlens" not in model.seen_kwargs  # upstream never sees the loader's key


def test_explicit_packed_seq_params_win_and_reach_the_decoder(stand_in):
    model = stand_in.vlm.StandInVLMModel()
    explicit = mindspeed_mm.packed_seq_params([3, 7])  # MindSpeed-MM style list, no leading zero
    assert explicit.cu_seqlens_q.tolist() == [0, 3, 7]
    batch = packed_batch([3, 4])
    model.forward(batch["input_ids"], None, None, batch["attention_mask"], None, None, None,
                  batch["position_ids"], explicit)
    assert model.text_decoder.calls[-1]["packed_seq_params"] is explicit


def test_unpacked_batches_keep_the_upstream_path(stand_in):
    model = stand_in.vlm.StandInVLMModel()
    batch = packed_batch([6])
    del batch["cu_seqlens"]
    model.forward(**batch)
    call = model.text_decoder.calls[-1]
    assert call["packed_seq_params"] is None and call["attention_mask"].shape == (1, 1, 6, 6)
    assert stand_in.mask.BUILT == [6]


def test_packed_batch_without_position_ids_is_refused(stand_in):
    model = stand_in.vlm.StandInVLMModel()
    with pytest.raises(ValueError, match="position_ids"):
        model.forward(**packed_batch([4, 4], with_positions=False))


def test_vit_get_args_view_reads_flash_and_writes_through():
    real = SimpleNamespace(use_flash_attn=False, sequence_parallel=True)
    view = mindspeed_mm.vit_get_args(lambda: real, None, (), {})
    assert view.use_flash_attn is True and view.sequence_parallel is True
    view.micro_batch_size = 3
    assert real.micro_batch_size == 3 and real.use_flash_attn is False


def stand_in_mrope(q, k, cos, sin, use_fused_rope=False):
    """Stand-in for upstream's non-fused apply_multimodal_rotary_pos_emb (rotate-half RoPE)."""
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def test_mrope_applies_on_squeezed_packed_queries():
    torch.manual_seed(0)
    t, h, d = 9, 4, 8
    q, k = torch.randn(t, 1, h, d), torch.randn(t, 1, 2, d)
    cos, sin = torch.randn(t, 1, 1, d), torch.randn(t, 1, 1, d)
    want_q, want_k = stand_in_mrope(q, k, cos, sin)
    got_q, got_k = mindspeed_mm.mrope_on_packed(stand_in_mrope, None, (q.squeeze(1), k.squeeze(1), cos, sin), {})
    assert got_q.shape == (t, h, d) and got_k.shape == (t, 2, d)
    torch.testing.assert_close(got_q, want_q.squeeze(1))
    torch.testing.assert_close(got_k, want_k.squeeze(1))
    # unpacked 4-D queries pass through untouched
    same_q, _ = mindspeed_mm.mrope_on_packed(stand_in_mrope, None, (), dict(q=q, k=k, cos=cos, sin=sin))
    torch.testing.assert_close(same_q, want_q)


@pytest.mark.skipif(not os.environ.get("MINDSPEED_MM_SRC"), reason="MINDSPEED_MM_SRC not set")
def test_declared_targets_exist_in_mindspeed_mm_source():
    from mindspeed_flow.patching.check import check_source

    root = Path(os.environ["MINDSPEED_MM_SRC"])
    for patch in fused_attn.PATCHES + conv_matmul.PATCHES:
        if patch.module.startswith("mindspeed_mm"):
            status = check_source(patch, [root], "source")
            assert status.status == "found", status
