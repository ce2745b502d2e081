"""Packs padded to what tensor/sequence/context parallelism need (issue 19, defect 7).

Megatron's ``--sequence-parallel`` scatters the embedding output over the TP ranks: the
pack's length must divide by TP (x 2 CP with context parallelism).  The padding is a
segment of its own at the end (label -100, attention mask 0), counted as padding, and the
packed loss does not change.
"""

from __future__ import annotations

import pytest
import torch

from mindspeed_flow.attention.varlen import varlen_attention
from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.batch import collate_pack, pack_multiple, padded_length, real_tokens
from mindspeed_flow.data.decode import Sample
from mindspeed_flow.data.tokenizer import load_tokenizer
from mindspeed_flow.recipes.loss_weighting import per_sample_sums

from data_corpus import SAMPLES, demo_corpus

CAPACITY = 999  # a multiple of 3 and of nothing larger that packs tend to fill


def _sample(index: int, length: int, seed: int) -> Sample:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 60, (length,), generator=g)
    labels = ids.clone()
    labels[: length // 2] = -100  # a prompt
    positions = torch.arange(length).expand(3, length).clone()
    return Sample(index, f"s.jsonl:{index + 1}", ids, labels, positions, torch.zeros(0, 1176, dtype=torch.uint8),
                  torch.zeros(0, 3, dtype=torch.int64))


@pytest.mark.parametrize("tp, cp, sp, expected", [(1, 1, False, 1), (2, 1, False, 1), (2, 1, True, 2),
                                                  (4, 1, True, 4), (1, 2, False, 4), (2, 2, True, 8)])
def test_pack_multiple_of_tensor_context_and_sequence_parallelism(tp, cp, sp, expected):
    assert pack_multiple(tp, cp, sp) == expected


def test_padding_is_a_masked_segment_of_its_own():
    samples = [_sample(0, 7, 1), _sample(1, 6, 2)]  # 13 tokens
    plain = collate_pack(samples)
    padded = collate_pack(samples, multiple=4, pad_id=3)
    assert plain["input_ids"].shape == (1, 13) and plain["cu_seqlens"].tolist() == [0, 7, 13]
    assert padded["input_ids"].shape == (1, 16) and padded["cu_seqlens"].tolist() == [0, 7, 13, 16]
    assert padded["cu_seqlens"].dtype == torch.int32
    assert padded["input_ids"][0, 13:].tolist() == [3, 3, 3]
    assert padded["labels"][0, 13:].tolist() == [-100] * 3
    assert padded["attention_mask"].tolist() == [[1] * 13 + [0] * 3]
    assert padded["position_ids"].shape == (3, 1, 16)
    assert padded["position_ids"][:, 0, 13:].tolist() == [[0, 1, 2]] * 3
    for key in ("input_ids", "labels", "attention_mask"):
        assert torch.equal(padded[key][:, :13], plain[key])
    assert torch.equal(padded["position_ids"][:, :, :13], plain["position_ids"])
    assert padded["sample_ids"] == plain["sample_ids"]
    assert real_tokens(padded) == real_tokens(plain) == 13
    # already a multiple: nothing added, no extra segment
    assert collate_pack(samples, multiple=13)["cu_seqlens"].tolist() == [0, 7, 13]
    assert padded_length(13, 4) == 16 and padded_length(16, 4) == 16


class TinyCausalLM(torch.nn.Module):
    """Embedding, one varlen causal self-attention layer, LM head: attention only within
    each ``cu_seqlens`` segment, as the packed LLM attends."""

    def __init__(self, vocab: int = 64, hidden: int = 16, heads: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids[0])
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, -1).unbind(1)
        return self.head(x + varlen_attention(q, k, v, cu_seqlens, cu_seqlens, causal=True).flatten(1))


def _packed_loss(model: TinyCausalLM, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """MindSpeed-MM's loss of a microbatch: shifted cross-entropy averaged over labels != -100."""
    logits = model(batch["input_ids"], batch["cu_seqlens"])
    per_token = torch.nn.functional.cross_entropy(logits[:-1], batch["labels"][0, 1:], reduction="none",
                                                  ignore_index=-100)
    mask = batch["labels"][0, 1:] > -1
    return (per_token * mask).sum() / mask.sum(), logits


def test_packed_loss_and_gradients_unchanged_by_padding():
    samples = [_sample(0, 9, 3), _sample(1, 5, 4), _sample(2, 8, 5)]  # 22 tokens
    model = TinyCausalLM()
    plain_loss, plain_logits = _packed_loss(model, collate_pack(samples))
    plain_loss.backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    padded_loss, padded_logits = _packed_loss(model, collate_pack(samples, multiple=8, pad_id=0))
    padded_loss.backward()
    assert padded_logits.shape[0] == 24
    torch.testing.assert_close(padded_logits[:22], plain_logits, rtol=0, atol=0)  # no real token sees the padding
    torch.testing.assert_close(padded_loss, plain_loss, rtol=0, atol=0)
    for got, want in zip((p.grad for p in model.parameters()), plain_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_per_sample_loss_sums_ignore_the_padding_segment():
    samples = [_sample(0, 9, 3), _sample(1, 5, 4)]
    plain, padded = collate_pack(samples), collate_pack(samples, multiple=8)
    for batch in (plain, padded):
        batch["losses"] = torch.arange(batch["labels"].shape[1], dtype=torch.float32).unsqueeze(0)
    want = per_sample_sums(plain["losses"], plain["labels"], plain["cu_seqlens"], 2)
    got = per_sample_sums(padded["losses"], padded["labels"], padded["cu_seqlens"], 2)
    torch.testing.assert_close(got[0], want[0])
    assert got[1].tolist() == want[1].tolist()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return demo_corpus(tmp_path_factory)


def test_loader_pads_every_pack_and_counts_the_padding(corpus):
    unpadded = FlowDataLoader(corpus, None, capacity=CAPACITY, num_workers=0, window=8, seed=3, max_pixels=224 * 224)
    padded = FlowDataLoader(corpus, None, capacity=CAPACITY, num_workers=0, window=8, seed=3, max_pixels=224 * 224,
                            pad_multiple=3)
    plain, packs = list(unpadded), list(padded)
    assert [b["sample_ids"] for b in packs] == [b["sample_ids"] for b in plain]  # same packs
    assert len({i for b in packs for i in b["sample_ids"]}) == SAMPLES
    pad_id = load_tokenizer(None, corpus).special.pad
    lengths = [b["input_ids"].shape[1] for b in plain]
    assert any(n % 3 for n in lengths)  # the test sees packs that need padding
    for b, n in zip(packs, lengths):
        T = b["input_ids"].shape[1]
        assert T % 3 == 0 and n <= T < n + 3 and T <= CAPACITY
        assert real_tokens(b) == n and b["input_ids"][0, n:].tolist() == [pad_id] * (T - n)
        assert b["cu_seqlens"][-1] == T and len(b["cu_seqlens"]) == len(b["sample_ids"]) + 1 + (T > n)
    stats = padded.stats
    assert stats.tokens == unpadded.stats.tokens == sum(lengths)
    assert stats.pad_tokens == sum(b["input_ids"].shape[1] for b in packs) - sum(lengths) > 0
    assert unpadded.stats.pad_tokens == 0
    assert stats.fill == unpadded.stats.fill  # padding is not a real token: it counts as padding
    assert stats.padding == pytest.approx(1 - stats.tokens / (stats.packs * CAPACITY))


def test_capacity_must_be_a_multiple_of_the_padding(corpus):
    with pytest.raises(ValueError, match="capacity 1000 must be a multiple of pad_multiple 3"):
        FlowDataLoader(corpus, None, capacity=1000, num_workers=0, pad_multiple=3)
