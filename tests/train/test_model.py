"""The main job's tiny VLM (``mindspeed_flow.train.model`` / ``.batches``) on real demo packs,
megatron-core's real GPTModel and schedules, fp32 on CPU:

- the four ViT variants (Conv3d / matmul patch embedding x dense / varlen attention) are the
  same function, and attention stays inside each image;
- the core parity of the job: one pack in varlen mode (THD through the ``fused_attn`` patch,
  matmul patch embedding) gives the loss and gradients of the same samples as padded
  microbatches with dense masks (MindSpeed-MM's layout), and of the pack under a dense
  block-diagonal mask (parity mode);
- the loss convention: the ``loss_tokens`` denominator, no target across a sample boundary
  or into padding, padding never contributing;
- a pipeline split (uneven, 1 + 3 layers, two gloo processes) starts from the 1-stage
  model's weights under global names, and Megatron's own 1F1B over it gives exactly the
  loss and gradients of the step loss (its division by the number of microbatches is
  compensated), dense and varlen.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.conversation import IGNORE
from mindspeed_flow.data.demo import make_demo_corpus
from mindspeed_flow.data.tokenizer import load_tokenizer
from markers import requires_megatron_core

pytestmark = requires_megatron_core

CAPACITY = 512
PACKS = 2
MICRO_BATCH_SIZE = 3
SPLIT = [1, 3]


def _config(corpus) -> Any:
    from mindspeed_flow.train.model import ModelConfig

    tokenizer = load_tokenizer(None, corpus)
    return ModelConfig(vit_hidden=32, vit_layers=2, vit_heads=4, llm_hidden=32, llm_layers=sum(SPLIT), llm_heads=4,
                       llm_ffn=64, vocab_size=tokenizer.backend.get_vocab_size(),
                       image_token_id=tokenizer.special.image_pad, seed=11)


def _packs(corpus) -> list[dict]:
    packs = []
    for pack in FlowDataLoader(corpus, None, capacity=CAPACITY, num_workers=0, seed=3):
        packs.append(pack)
        if len(packs) == PACKS:
            return packs
    raise AssertionError("the demo corpus gave fewer packs than the test needs")


def _fused_attn_registry():
    from mindspeed_flow.patches import fused_attn
    from mindspeed_flow.patching import PatchRegistry

    registry = PatchRegistry(fused_attn.PATCHES)
    registry.enable({"fused_attn"})
    return registry


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_demo_corpus(tmp_path_factory.mktemp("train_model_corpus"), samples=16, seed=5)


@pytest.fixture(scope="module")
def megatron(corpus):
    """This process as a one-rank gloo world with Megatron's parallel state (CPU shims) and
    the ``fused_attn`` patch, all undone after the module's tests."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mindspeed_flow.adapters.megatron.core import enable_cpu_shims

    registry = _fused_attn_registry()
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    shims = enable_cpu_shims()
    parallel_state.initialize_model_parallel()
    try:
        yield _config(corpus), _packs(corpus)
    finally:
        parallel_state.destroy_model_parallel()
        shims.remove()
        if owns_group:
            dist.destroy_process_group()
        registry.remove()


def _model(cfg, layers, stage, *, flow: bool):
    """The backbone stage (+ ViT inside stage 0) the way one of the two runs builds it:
    FlowTrain = THD/varlen/matmul, baseline = dense/Conv3d."""
    from mindspeed_flow.train.model import StageModule, build_gpt_stage, init_vision_encoder

    gpt = build_gpt_stage(cfg, layers, stage, packed=flow)
    vit = init_vision_encoder(cfg, conv_matmul=flow, varlen=flow) if stage == 0 else None
    return StageModule(gpt, vit=vit)


def _batches(cfg, packs, layout: str) -> list:
    from mindspeed_flow.train.batches import count_loss_tokens, from_pack, padded_microbatches

    loss_tokens = count_loss_tokens(packs)
    if layout == "padded":
        return padded_microbatches(packs, MICRO_BATCH_SIZE, loss_tokens, image_token_id=cfg.image_token_id)
    return [from_pack(pack, loss_tokens, layout) for pack in packs]


def _grads(module) -> dict[str, torch.Tensor]:
    """Gradients by global name; the ViT's patch kernel in the conv layout (both runs)."""
    from mindspeed_flow.adapters.megatron.global_names import global_name, layer_offset

    offset = layer_offset(module.gpt)
    grads = {f"gpt.{global_name(n, offset)}": p.grad.clone() for n, p in module.gpt.named_parameters()}
    if module.vit is not None:
        for name, p in module.vit.named_parameters():
            grads[f"vit.{name}"] = p.grad.reshape(p.shape[0], -1).clone()
    return grads


def _direct_step(module, batches) -> tuple[float, dict[str, torch.Tensor]]:
    """The step loss and its gradients by plain autograd: each microbatch's share through
    :func:`forward_step`'s loss function, backward, summed (no schedule involved)."""
    from mindspeed_flow.train.model import forward_step

    module.zero_grad(set_to_none=True)
    total = 0.0
    for batch in batches:
        output, loss_func = forward_step(iter([batch]), module)
        share, _, reported = loss_func(output)
        share.backward()
        total += float(reported["loss"])
    return total, _grads(module)


def _assert_same_grads(got: dict, expected: dict, rtol: float = 1e-5) -> None:
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert want.abs().max() > 0, name  # every parameter takes part in the step
        torch.testing.assert_close(got[name], want, rtol=rtol, atol=rtol * float(want.abs().max()), msg=name)


# --------------------------------------------------------------------------- (1) the ViT


def test_vision_encoder_variants_agree_and_attend_within_each_image(megatron):
    from mindspeed_flow.attention.patch_embed import PatchEmbedMatmul
    from mindspeed_flow.train.model import image_cu_seqlens, init_vision_encoder

    cfg, packs = megatron
    batch = _batches(cfg, packs, "varlen")[0]
    assert len(batch.image_grid_thw) >= 2
    outputs = {}
    for conv_matmul in (False, True):
        for varlen in (False, True):
            vit = init_vision_encoder(cfg, conv_matmul=conv_matmul, varlen=varlen)
            assert isinstance(vit.patch_embed, PatchEmbedMatmul) is conv_matmul
            outputs[conv_matmul, varlen] = vit(batch)
    reference = outputs[False, False]  # Conv3d + one dense block-diagonal mask: the baseline
    assert reference.shape == (batch.pixel_values.shape[0] // 4, cfg.llm_hidden)
    for key, out in outputs.items():
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5, msg=str(key))

    # Changing the second image's pixels leaves the first image's embeddings unchanged.
    cu = image_cu_seqlens(batch.image_grid_thw)
    changed = batch.pixel_values.clone()
    changed[cu[1]:cu[2]] = torch.randn(int(cu[2] - cu[1]), changed.shape[1])
    first = int(cu[1]) // 4
    for varlen in (False, True):
        vit = init_vision_encoder(cfg, conv_matmul=False, varlen=varlen)
        out = vit(replace(batch, pixel_values=changed))
        torch.testing.assert_close(out[:first], reference[:first], rtol=1e-6, atol=1e-6)
        assert not torch.allclose(out[first:first + int(cu[2] - cu[1]) // 4], reference[first:first + int(cu[2] - cu[1]) // 4])


# --------------------------------------------------------------------------- (2) the core parity


def test_varlen_pack_equals_padded_dense_microbatches(megatron):
    """FlowTrain's microbatch (a pack, varlen) against the baseline's (the same samples
    padded, dense masks, Conv3d) and against the pack under a dense block-diagonal mask
    (parity mode): the same step loss and the same gradients of every parameter."""
    cfg, packs = megatron
    runs = {}
    for layout, flow in (("varlen", True), ("padded", False), ("dense", False)):
        batches = _batches(cfg, packs, layout)
        runs[layout] = _direct_step(_model(cfg, [cfg.llm_layers], 0, flow=flow), batches)
    padded = _batches(cfg, packs, "padded")
    assert len(padded) > 1 and max(b.input_ids.shape[0] for b in padded) == MICRO_BATCH_SIZE
    assert sum(b.padded_tokens for b in padded) > sum(b.real_tokens for b in padded)  # padding exists
    loss, grads = runs["varlen"]
    assert loss > 1.0  # an untrained model over hundreds of tokens: log(vocab)-ish
    for layout in ("padded", "dense"):
        assert runs[layout][0] == pytest.approx(loss, rel=1e-5, abs=0), layout
        _assert_same_grads(runs[layout][1], grads)


# --------------------------------------------------------------------------- (4) the loss convention


def test_loss_tokens_count_next_labels_within_each_sample(megatron):
    from mindspeed_flow.train.batches import count_loss_tokens

    cfg, packs = megatron
    per_sample = 0
    for pack in packs:
        cu = pack["cu_seqlens"].tolist()
        for start, end in zip(cu[:-1], cu[1:]):
            labels = pack["labels"][0, start:end]
            assert labels[0] == IGNORE  # the loader's promise the shift relies on
            per_sample += int((labels[1:] != IGNORE).sum())
    assert count_loss_tokens(packs) == per_sample
    for batch in _batches(cfg, packs, "padded"):
        targets = batch.next_token_labels()
        for row, (start, end) in enumerate(zip(batch.segments[:-1].tolist(), batch.segments[1:].tolist())):
            n = end - start
            assert (targets[row, n - 1:] == IGNORE).all()  # nothing past the sample's end


def test_step_loss_is_cross_entropy_sum_over_loss_tokens(megatron):
    """The last stage's share equals torch's cross entropy of the logits against the next
    labels of each sample, summed, over the step's ``loss_tokens``; and padding tokens
    never change the loss or a gradient."""
    from mindspeed_flow.train.model import forward_step

    cfg, packs = megatron
    module = _model(cfg, [cfg.llm_layers], 0, flow=True)
    batch = _batches(cfg, packs, "varlen")[0]
    captured = {}  # a copy: Megatron's cross entropy works in place on the logits
    handle = module.gpt.output_layer.register_forward_hook(
        lambda m, args, out: captured.update(logits=out[0].detach().clone()))
    output, loss_func = forward_step(iter([batch]), module)
    handle.remove()
    share, tokens, reported = loss_func(output)
    logits = captured["logits"][:, 0]  # [T, V]
    expected = 0.0
    cu = batch.segments.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        expected += F.cross_entropy(logits[start:end - 1], batch.labels[0, start + 1:end], ignore_index=IGNORE,
                                    reduction="sum")
    torch.testing.assert_close(share, expected / batch.loss_tokens, rtol=1e-6, atol=0)
    assert int(tokens) == int((batch.labels[0, 1:] != IGNORE).sum()) < batch.loss_tokens
    assert reported["loss"] == share.detach()

    baseline = _model(cfg, [cfg.llm_layers], 0, flow=False)
    padded = next(b for b in _batches(cfg, packs, "padded") if b.padded_tokens > b.real_tokens)
    noise = replace(padded, input_ids=padded.input_ids.clone())
    is_pad = torch.ones_like(padded.input_ids, dtype=torch.bool)
    for row, n in enumerate(padded.segments.diff().tolist()):
        is_pad[row, :n] = False
    noise.input_ids[is_pad] = torch.randint(6, cfg.vocab_size, (int(is_pad.sum()),))
    clean_loss, clean_grads = _direct_step(baseline, [padded])
    noisy_loss, noisy_grads = _direct_step(baseline, [noise])
    assert noisy_loss == clean_loss
    for name, grad in clean_grads.items():
        assert torch.equal(noisy_grads[name], grad), name


def test_loss_func_refuses_an_output_that_is_not_the_per_token_loss(megatron):
    from mindspeed_flow.train.model import forward_step, init_vision_encoder

    cfg, packs = megatron
    batch = _batches(cfg, packs, "varlen")[0]
    output, loss_func = forward_step(iter([batch]), init_vision_encoder(cfg, conv_matmul=True, varlen=True))
    with pytest.raises(ValueError, match="per-token loss"):
        loss_func(output)


# --------------------------------------------------------------------------- (3) splits + Megatron's 1F1B


def _split_worker(rank: int, world_size: int, corpus) -> dict:
    """Each rank: the 1-stage model alone (direct autograd), then its stage of the 1 + 3
    split under Megatron's 1F1B over PP=2, dense (padded) and varlen (packs)."""
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving
    from megatron_cpu_harness import megatron_parallel

    from mindspeed_flow.adapters.megatron.global_names import global_state_dict
    from mindspeed_flow.train.model import forward_step

    registry = _fused_attn_registry()
    try:
        cfg, packs = _config(corpus), _packs(corpus)
        out: dict[str, Any] = {}
        with megatron_parallel(1):
            whole = _model(cfg, [cfg.llm_layers], 0, flow=True)
            out["weights"] = global_state_dict(whole.gpt)
            out["reference"] = _direct_step(whole, _batches(cfg, packs, "varlen"))
        with megatron_parallel(2):
            for layout, flow in (("padded", False), ("varlen", True)):
                module = _model(cfg, SPLIT, rank, flow=flow)
                batches = _batches(cfg, packs, layout)
                module.zero_grad(set_to_none=True)
                reported = forward_backward_pipelining_without_interleaving(
                    forward_step_func=forward_step, data_iterator=iter(batches), model=module,
                    num_microbatches=len(batches), seq_length=max(b.input_ids.shape[1] for b in batches),
                    micro_batch_size=max(b.input_ids.shape[0] for b in batches))
                out[layout] = (sum(float(r["loss"]) for r in reported), _grads(module), len(batches))
            out["stage_weights"] = global_state_dict(module.gpt)
            out["executor"] = _executor_step(cfg, packs, rank)
    finally:
        registry.remove()
    return out


def _executor_step(cfg, packs, rank: int) -> tuple[float, dict[str, torch.Tensor], int]:
    """FlowTrain's shape of the step on the plugin's executor: the ViT a replicated
    region of its own (microbatch m's on rank m % 2), its embeddings sent to the backbone's
    stage 0 as pipeline input, the backbone 1F1B over the split, varlen packs."""
    from mindspeed_flow.runtime import Binding, Executor
    from mindspeed_flow.runtime.layout import plan_for, vlm_layout
    from mindspeed_flow.train.model import (
        StageModule, build_gpt_stage, forward_step, init_vision_encoder, loss_rules)

    stage = StageModule(build_gpt_stage(cfg, SPLIT, rank, packed=True))
    vit = init_vision_encoder(cfg, conv_matmul=True, varlen=True)
    batches = _batches(cfg, packs, "varlen")
    data = iter(batches)
    plan = plan_for(vlm_layout([cfg.vit_layers, 0], SPLIT, transpose=True), len(batches))
    bindings = {("vit", 0): Binding(vit, data), ("llm", rank): Binding(stage, data)}
    result = Executor(rank, [0, 1]).run(plan, forward_step, bindings, loss=loss_rules())
    grads = _grads(stage)
    grads.update({f"vit.{n}": p.grad.reshape(p.shape[0], -1).clone() for n, p in vit.named_parameters()})
    return sum(float(r["loss"]) for r in result.forward_data_store), grads, len(batches)


@pytest.fixture(scope="module")
def split_runs(corpus):
    from megatron_cpu_harness import launch

    return launch(_split_worker, 2, corpus, timeout_s=240)


def test_split_stages_hold_the_whole_models_weights(split_runs):
    first, last = split_runs
    whole = first["weights"]
    merged = {**first["stage_weights"], **last["stage_weights"]}
    assert set(merged) == set(whole)
    assert not set(first["stage_weights"]) & {k for k in last["stage_weights"] if k.startswith("decoder.layers.")}
    assert any(k.startswith("decoder.layers.3.") for k in last["stage_weights"])
    for name, value in whole.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(merged[name], value), name


@pytest.mark.parametrize("layout", ["padded", "varlen", "executor"])
def test_split_pipelines_give_the_step_loss_gradients(split_runs, layout):
    """Megatron's 1F1B over the split (baseline: padded, ViT in stage 0; and varlen packs)
    and the plugin's executor (ViT decoupled) reproduce the step loss and its gradients."""
    first, last = split_runs
    loss, grads = first["reference"]
    assert first[layout][2] > 1  # several microbatches: Megatron's division would show
    assert first[layout][0] == 0.0  # only the last stage computes the loss
    assert last[layout][0] == pytest.approx(loss, rel=1e-5, abs=0)
    _assert_same_grads({**first[layout][1], **last[layout][1]}, grads)
