"""The main job's runs on 4 gloo ranks: the baseline (PP=2 x DP=2, ViT in stage 0,
megatron-core's own 1F1B), the three-phase baseline (a ViT replica on every rank encodes the
step first, then the same PP=2 x DP=2 1F1B on detached embeddings, then the ViT backward)
and FlowTrain (2 ViT replicas + a PP=2 GPT over the shm pool).

Fed the same packs (parity mode) their step losses agree with each other and with one
process training the whole VLM with one AdamW (dense masks, no schedule): the gradients
both runs hand the optimizer are the step loss's.  The padded baseline (samples one per
row) gives the same first loss.  A trainer that loads another's checkpoint after step 2
continues exactly: same step-3 loss, same weights and optimizer moments after step 3.
The baseline's measured timeline has one F and one B per microbatch per stage; FlowTrain's
has the pool's PUT and GET.
"""

from __future__ import annotations

import pytest
import torch

from markers import requires_megatron_core

pytestmark = requires_megatron_core

WORLD = 4
STEPS = 3
SAVE_AFTER = 2
VOCAB = 64
IMAGE_TOKEN = VOCAB - 1
PACKS_PER_STEP = 4
KINDS = ("baseline", "three-phase", "flowtrain")


def _config():
    from mindspeed_flow.train.config import DataConfig, LayoutConfig, OptimConfig, TrainConfig
    from mindspeed_flow.train.model import ModelConfig

    model = ModelConfig(vit_hidden=16, vit_layers=1, vit_heads=2, llm_hidden=32, llm_layers=2, llm_heads=4,
                        llm_ffn=64, vocab_size=VOCAB, image_token_id=IMAGE_TOKEN, seed=7)
    return TrainConfig(model=model, data=DataConfig(capacity=96, packs_per_step=PACKS_PER_STEP, micro_batch_size=2),
                       layout=LayoutConfig(world_size=WORLD, baseline_pp=2, use_allocator=True, flow_encoder_dp=2,
                                           flow_backbone_pp=2, flow_backbone_dp=1, max_ahead=2, pool_backend="shm"),
                       optim=OptimConfig(lr=1e-2), steps=STEPS, resume_at=SAVE_AFTER)


def _config_layout(cfg):
    """FlowTrain in the config's layout (2 ViT ranks + a 2-stage GPT pipeline), not the
    allocator's (2 slices of 1 ViT rank + a 1-stage GPT, which the ``flowtrain`` run is)."""
    import dataclasses

    return dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, use_allocator=False))


def _sample(index: int, g: torch.Generator):
    """A sample with 1 or 2 images of 4 merged tokens each (a 1x4x4 patch grid) and text."""
    from mindspeed_flow.data.decode import Sample

    images = 1 + index % 2
    text = int(torch.randint(5, 14, (), generator=g))
    ids = torch.cat([torch.full((4 * images,), IMAGE_TOKEN), torch.randint(0, VOCAB - 1, (text,), generator=g)])
    labels = ids.clone()
    labels[: 4 * images] = -100
    return Sample(index, f"synthetic:{index}", ids, labels, torch.arange(len(ids)).expand(3, -1).clone(),
                  torch.randint(0, 256, (16 * images, 1176), generator=g, dtype=torch.uint8),
                  torch.tensor([[1, 4, 4]] * images))


def _steps():
    """``STEPS + 1`` steps of ``PACKS_PER_STEP`` packs of 1 to 3 samples."""
    from mindspeed_flow.data.batch import collate_pack
    from mindspeed_flow.train.batches import count_loss_tokens
    from mindspeed_flow.train.feed import StepData

    g = torch.Generator().manual_seed(3)
    steps, index = [], 0
    for step in range(1, STEPS + 2):
        packs = []
        for _ in range(PACKS_PER_STEP):
            n = int(torch.randint(1, 4, (), generator=g))
            packs.append(collate_pack([_sample(index + k, g) for k in range(n)]))
            index += n
        steps.append(StepData(step, packs, count_loss_tokens(packs)))
    return steps


def _reference(steps, cfg) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The whole VLM in this process alone (PP=1), dense masks, one AdamW: step losses and
    the first step's gradients."""
    from mindspeed_flow.train.batches import from_pack
    from mindspeed_flow.train.model import StageModule, build_gpt_stage, init_vision_encoder

    model = StageModule(build_gpt_stage(cfg.model, [cfg.model.llm_layers], 0, packed=False),
                        vit=init_vision_encoder(cfg.model, conv_matmul=False, varlen=False))
    opt = cfg.optim
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                  weight_decay=opt.weight_decay)
    losses, grads = [], {}
    for data in steps:
        optimizer.zero_grad(set_to_none=True)
        loss = sum(model(from_pack(p, data.loss_tokens, "dense")).sum() / data.loss_tokens for p in data.packs)
        loss.backward()
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = grads or _named_grads(model)
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, grads


def _named_grads(module) -> dict[str, torch.Tensor]:
    """Gradients of a rank's module by global name (``gpt.decoder.layers.{global}...``,
    ``vit...``), flattened (the matmul patch embedding holds the Conv3d kernel flat)."""
    from mindspeed_flow.adapters.megatron.global_names import global_name, layer_offset

    gpt = getattr(module, "gpt", None)
    vit = module.vit if gpt is not None else module
    grads = {}
    if gpt is not None:
        grads.update({f"gpt.{global_name(n, layer_offset(gpt))}": p.grad for n, p in gpt.named_parameters()})
    if vit is not None:
        grads.update({f"vit.{n}": p.grad for n, p in vit.named_parameters()})
    return {name: g.detach().reshape(-1).clone() for name, g in grads.items()}


def _trainer_grads(trainer) -> dict[str, torch.Tensor]:
    """:func:`_named_grads` of the rank's stage, and of its ViT replica when it has one
    outside the stage (the three-phase run's)."""
    grads = _named_grads(trainer.model)
    vit = getattr(trainer, "vit", None)
    if vit is not None:
        grads.update({f"vit.{n}": p.grad.detach().reshape(-1).clone() for n, p in vit.named_parameters()})
    return grads


def _through_file(state: dict) -> dict:
    """``state`` after ``torch.save`` and ``torch.load``, as the job's checkpoint files hold it."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _flat(trainer) -> torch.Tensor:
    """Every weight and AdamW moment of this rank, flattened."""
    state = trainer.optimizer.state
    parts = [t.reshape(-1) for p in trainer.parameters() for t in (p.detach(), state[p]["exp_avg"],
                                                                    state[p]["exp_avg_sq"])]
    return torch.cat(parts).clone()


def _worker(rank, world_size):
    from megatron.core import parallel_state

    from mindspeed_flow.adapters.megatron.core import enable_cpu_shims
    from mindspeed_flow.train.launch import DistEnv
    from mindspeed_flow.adapters.megatron.parallel import destroy_model_parallel
    from mindspeed_flow.train.trainer import CheckpointMismatch, build_trainer, peak_memory_mb

    shims = enable_cpu_shims()
    try:
        cfg, steps = _config(), _steps()
        env = DistEnv(rank, world_size, rank, torch.device("cpu"), "gloo", cpu=True)
        ballast = torch.ones(64 << 20)  # 256 MB that no run's peak may include
        out = {"peak_before": peak_memory_mb(env.device)}
        del ballast
        saved = {}
        for kind in KINDS:
            trainer = build_trainer(kind, cfg, env, parity=True)
            outcomes = [trainer.train_step(steps[0])]
            first_grads = _trainer_grads(trainer)
            outcomes += [trainer.train_step(data) for data in steps[1:SAVE_AFTER]]
            saved[kind] = _through_file(trainer.state_dict())
            outcomes += [trainer.train_step(data) for data in steps[SAVE_AFTER:STEPS]]
            after = _flat(trainer)
            info = {"role": trainer.role, "plan_text": trainer.plan_text, "features": trainer.features,
                    "layout": trainer.layout,
                    "record": trainer.rank_record(), "grads": first_grads}
            trainer.close()
            resumed = build_trainer(kind, cfg, env, parity=True)
            resumed.load_state_dict(saved[kind])
            again = [resumed.train_step(data) for data in steps[SAVE_AFTER:STEPS]]
            info.update(outcomes=outcomes, resumed=again, same_after_resume=torch.equal(after, _flat(resumed)))
            resumed.close()
            out[kind] = info
        padded = build_trainer("baseline", cfg, env, parity=False)
        out["padded"] = padded.train_step(steps[0])
        padded.close()
        flow_pp = build_trainer("flowtrain", _config_layout(cfg), env, parity=True)
        out["flow_pp"] = {"outcome": flow_pp.train_step(steps[0]), "grads": _named_grads(flow_pp.model),
                          "role": flow_pp.role, "plan_text": flow_pp.plan_text}
        for kind, state in saved.items():  # another run's, or the same run's in another layout
            with pytest.raises(CheckpointMismatch, match=f"checkpoint of .*'run': '{kind}'"):
                flow_pp.load_state_dict(state)
        flow_pp.close()
        parallel_state.initialize_model_parallel(pipeline_model_parallel_size=1)
        try:
            out["reference"] = _reference(steps[:STEPS], cfg) if rank == 0 else None
        finally:
            destroy_model_parallel()
        return out
    finally:
        shims.remove()


@pytest.fixture(scope="module")
def ranks():
    from megatron_cpu_harness import launch

    return launch(_worker, WORLD, timeout_s=300)


def _losses(outcomes):
    return [o.loss for o in outcomes]


def test_parity_losses_equal_each_other_and_single_process(ranks):
    reference, _ = ranks[0]["reference"]
    for kind in KINDS:
        for rank in ranks:  # every rank reports the step loss
            assert _losses(rank[kind]["outcomes"]) == _losses(ranks[0][kind]["outcomes"])
    baseline, *others = (_losses(ranks[0][k]["outcomes"]) for k in KINDS)
    for got in (baseline, *others):
        assert got[0] == pytest.approx(reference[0], rel=1e-5, abs=0)
        assert got[1:] == pytest.approx(reference[1:], rel=1e-4, abs=0)
    for got in others:
        assert got[0] == pytest.approx(baseline[0], rel=1e-5, abs=0)
        assert got[1:] == pytest.approx(baseline[1:], rel=1e-4, abs=0)


def test_gradients_are_the_step_losses(ranks):
    """Every rank's first-step gradients (after the runs' reductions) are the single
    process's: AdamW hides a wrong gradient scale from the losses, this does not: FlowTrain
    in the allocator's layout (two backbone replicas: average_grads over them, each its
    share) and in the config's (one 2-stage backbone pipeline); the three-phase run's ViT
    replicas (each encoded part of the step: summed over the world) and its LLM stages."""
    _, reference = ranks[0]["reference"]
    for kind in (*KINDS, "flow_pp"):
        seen = set()
        for rank, got in enumerate(ranks):
            for name, grad in got[kind]["grads"].items():
                torch.testing.assert_close(grad, reference[name], rtol=1e-4, atol=1e-7, msg=f"{kind} r{rank} {name}")
                seen.add(name)
        assert seen == set(reference), (kind, set(reference) ^ seen)


def test_flow_config_layout_pipeline_step_loss(ranks):
    reference, _ = ranks[0]["reference"]
    assert [got["flow_pp"]["role"] for got in ranks][2:] == ["LLM pp0 dp0", "LLM pp1 dp0"]
    assert "use_allocator is false" in ranks[0]["flow_pp"]["plan_text"]
    for got in ranks:
        assert got["flow_pp"]["outcome"].loss == pytest.approx(reference[0], rel=1e-5, abs=0)


def test_padded_baseline_has_the_same_first_loss_and_counts_padding(ranks):
    padded, packed = ranks[0]["padded"], ranks[0]["baseline"]["outcomes"][0]
    assert padded.loss == pytest.approx(packed.loss, rel=1e-5, abs=0)
    assert (padded.samples, padded.tokens) == (packed.samples, packed.tokens)
    assert packed.padded_tokens == packed.tokens < padded.padded_tokens
    # the replicas (stage 0 on ranks 0 and 1) share the padded microbatches evenly
    forwards = [sum(iv.kind == "F" and iv.region == "llm" for iv in got["padded"].intervals) for got in ranks[:2]]
    assert sum(forwards) == -(-padded.samples // 2) and abs(forwards[0] - forwards[1]) <= 1


def test_resume_continues_exactly(ranks):
    for kind in KINDS:
        for rank, got in enumerate(ranks):
            run = got[kind]
            assert _losses(run["resumed"]) == _losses(run["outcomes"][SAVE_AFTER:]), (kind, rank)
            assert run["same_after_resume"], (kind, rank)


def test_baseline_timeline_has_one_forward_and_backward_per_microbatch_per_stage(ranks):
    """Per region of the stage: stage 0 (ranks 0, 1) runs the ViT first in its forward and
    last in its backward, then the LLM; stage 1 (ranks 2, 3) the LLM only."""
    microbatches = PACKS_PER_STEP // 2  # each of the 2 data-parallel replicas
    for rank, got in enumerate(ranks):
        regions = ("vit", "llm") if rank < 2 else ("llm",)
        for outcome in got["baseline"]["outcomes"]:
            computes = sorted((iv.region, iv.kind, iv.microbatch) for iv in outcome.intervals if iv.kind in "FB")
            assert computes == sorted((r, k, m) for r in regions for k in "FB" for m in range(microbatches)), rank
            assert all(0 <= iv.start <= iv.end <= outcome.step_s for iv in outcome.intervals)
            if rank < 2:
                by = {(iv.region, iv.kind, iv.microbatch): iv for iv in outcome.intervals}
                for m in range(microbatches):
                    assert by["vit", "F", m].end <= by["llm", "F", m].start
                    assert by["llm", "B", m].end <= by["vit", "B", m].start
        record = got["baseline"]["record"]
        assert 0 < record.busy_s < record.step_s and 0 < record.idle_fraction < 1
        assert 0 < record.peak_memory_mb < got["peak_before"]  # this run's peak, without the ballast


def test_three_phase_timeline_encodes_the_step_before_the_llm_and_backward_after(ranks):
    """Phase 1 (every rank's ViT forwards) ends before the rank's first LLM forward, phase 3
    (its ViT backwards) starts after its last LLM backward; the step's microbatches are
    dealt one per rank (4 packs, 4 ranks), each encoded once."""
    encoded = []
    for rank, got in enumerate(ranks):
        assert got["three-phase"]["role"].endswith("(ViT replica + LLM)")
        intervals = got["three-phase"]["outcomes"][0].intervals
        vit_f = [iv for iv in intervals if iv.region == "vit" and iv.kind == "F"]
        vit_b = [iv for iv in intervals if iv.region == "vit" and iv.kind == "B"]
        llm = [iv for iv in intervals if iv.region == "llm" and iv.kind in "FB"]
        assert vit_f and vit_b and llm, rank
        assert max(iv.end for iv in vit_f) <= min(iv.start for iv in llm), rank
        assert min(iv.start for iv in vit_b) >= max(iv.end for iv in llm), rank
        encoded += [iv.microbatch for iv in vit_f]
    assert sorted(encoded) == list(range(PACKS_PER_STEP))


def test_flow_timeline_has_pool_puts_and_gets(ranks):
    roles = [got["flowtrain"]["role"] for got in ranks]
    assert [r.split()[0] for r in roles] == ["ViT", "ViT", "LLM", "LLM"]
    for rank in range(WORLD):  # each ViT replica meets its backbone replica's (only) stage in the pool
        kinds = {iv.kind for iv in ranks[rank]["flowtrain"]["outcomes"][0].intervals}
        assert {"F", "B", "PUT", "GET"} <= kinds, (rank, kinds)
    for rank in (0, 1):  # each ViT rank feeds one of the 2 backbone replicas: its share's embeddings, once each
        forwards = sorted(iv.microbatch for iv in ranks[rank]["flowtrain"]["outcomes"][0].intervals if iv.kind == "F")
        assert forwards == list(range(PACKS_PER_STEP // 2)), rank
    # 4 CPU ranks: the allocator's best runnable plan (its unconstrained best co-locates) is what ran
    assert [got["flowtrain"]["role"] for got in ranks][2:] == ["LLM pp0 dp0", "LLM pp0 dp1"]
    assert ranks[0]["flowtrain"]["plan_text"].startswith("allocator plan used: decoupled: encoder dp=2 tp=1; "
                                                         "backbone pp=1 dp=2")
    assert "allocator plan" in ranks[0]["flowtrain"]["features"]


# --------------------------------------------------------------------------- layouts (one process)


def test_demo_runs_the_allocators_plan_for_its_ranks():
    """With the demo config's ranks the unconstrained best plan is co-located (no
    DecoupledLayout runs it); asked for runnable plans only (decoupled, Megatron's blocks,
    every rank), the allocator's best is what FlowTrain's layout is."""
    import dataclasses
    from pathlib import Path

    from mindspeed_flow.allocator import solve
    from mindspeed_flow.train.config import load_config
    from mindspeed_flow.train.flow import allocator_problem, flow_layout

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "train" / "demo.yaml")
    world = cfg.layout.world_size
    model, cluster, proxy, workload = allocator_problem(cfg, world)
    assert solve(model, cluster, proxy, workload).placement == "colocated"  # so the requirements matter
    plan = solve(model, cluster, proxy, dataclasses.replace(workload, placements=("decoupled",),
                                                            megatron_blocks=True, exact_devices=True))
    chosen = flow_layout(cfg, world)
    assert chosen.from_allocator and chosen.plan_text.startswith("allocator plan used: decoupled")
    d = chosen.decoupled
    assert (d.encoder_dp * d.backbone_dp, d.backbone_pp, d.backbone_dp) == (
        plan.encoder.dp, plan.backbone.pp, plan.backbone.dp)
    assert d.world_size == world and chosen.layer_split == plan.backbone.layer_split
    assert "best without the runtime's requirements: colocated" in chosen.plan_text


def test_flow_layout_follows_the_allocator_or_says_why_not():
    import dataclasses

    from mindspeed_flow.train.flow import flow_layout

    cfg = _config()
    for world in (4, 5, 6):
        chosen = flow_layout(cfg, world)
        assert chosen.from_allocator and chosen.decoupled.world_size == world
        assert f"backbone pp={chosen.decoupled.backbone_pp} dp={chosen.decoupled.backbone_dp}" in chosen.plan_text
    one_pack = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, packs_per_step=1))
    chosen = flow_layout(one_pack, 4)  # 1 sample a step: 1 encoder + 1 backbone replica cannot use 4 ranks
    assert not chosen.from_allocator and "runtime requirements" in chosen.plan_text
    assert (chosen.decoupled.encoder_dp, chosen.decoupled.backbone_pp) == (2, 2)  # the config's layout
    manual = dataclasses.replace(cfg, layout=dataclasses.replace(cfg.layout, use_allocator=False))
    assert "use_allocator is false" in flow_layout(manual, 4).plan_text
    with pytest.raises(ValueError, match="= 4 ranks, but the world has 6 .not the allocator's layout because "
                                         "layout.use_allocator is false"):
        flow_layout(manual, 6)
    lopsided = dataclasses.replace(manual, layout=dataclasses.replace(manual.layout, flow_encoder_dp=1,
                                                                      flow_backbone_pp=3))
    with pytest.raises(ValueError, match="1 encoder ranks are not a multiple of backbone_tp \\* backbone_pp = 3"):
        flow_layout(lopsided, 4)


def test_shares_and_splits():
    from mindspeed_flow.train.trainer import build_trainer, even_split, replica_share

    assert [replica_share(5, r, 2) for r in (0, 1)] == [[0, 1, 2], [3, 4]]
    assert [replica_share(4, r, 2) for r in (0, 1)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="3 microbatches in the step cannot feed 4 data-parallel replicas"):
        replica_share(3, 0, 4)
    assert even_split(5, 2) == [3, 2] and even_split(4, 4) == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="2 LLM layers cannot fill 3 pipeline stages"):
        even_split(2, 3)
    with pytest.raises(ValueError, match="unknown run 'fast'"):
        build_trainer("fast", _config(), None)
