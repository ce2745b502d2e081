"""Dynamic loss weighting on loader-shaped packed batches: per-task sums from ``sample_ids``
and ``cu_seqlens``, the inverse-moving-average rule, equal weights = the plain mean, the
resumable state, the training-loop API (:class:`LossWeighting`) and the flags.  The patch on
MindSpeed-MM's real ``VLMModel`` is tested in ``tests/upstream/test_upstream_loss_weighting.py``."""

from __future__ import annotations

import argparse

import pytest
import torch

from mindspeed_flow.recipes.loss_weighting import (
    DynamicLossWeighting, LossWeighting, loss_weighting_settings, per_sample_sums, per_task_sums, task_by_file,
)
from mindspeed_flow.recipes.module_lr import RecipeConfigError

TASK_OF = task_by_file({"*caption*": "caption", "*text*": "text"})


def batch():
    # three samples packed: caption (4 tokens), text (3), caption (3); first token of each ignored
    labels = torch.tensor([[-100, 1, 2, 3, -100, 4, 5, -100, 6, 7]])
    losses = torch.tensor([[9.0, 1.0, 2.0, 3.0, 9.0, 4.0, 6.0, 9.0, 0.5, 0.5]])
    return losses, labels, torch.tensor([0, 4, 7, 10], dtype=torch.int32), \
        ["data/caption-00.jsonl:3", "data/text-01.jsonl:7", "data/caption-00.jsonl:9#0/2"]


def test_per_task_sums_follow_sample_ids_and_labels():
    sums = per_task_sums(*batch(), TASK_OF)
    assert {t: (float(s), n) for t, (s, n) in sums.items()} == {"caption": (7.0, 5), "text": (10.0, 2)}
    losses, labels, cu, ids = batch()
    with pytest.raises(ValueError, match="cu_seqlens has 3 segments but the batch has 2 sample_ids"):
        per_task_sums(losses, labels, cu, ids[:2], TASK_OF)


def test_rule_inverse_moving_average_normalised():
    weighting = DynamicLossWeighting(beta=0.5)
    sums = per_task_sums(*batch(), TASK_OF)
    # before any update every weight is 1: the plain token mean
    assert float(weighting.loss(sums)) == pytest.approx(17.0 / 7)
    weights = weighting.update(sums, ["caption", "text"])
    # means 7/5 and 10/2 -> inverses 5/7 and 1/5, normalised to mean 1
    inv = {"caption": 5 / 7, "text": 1 / 5}
    mean = sum(inv.values()) / 2
    assert weights == pytest.approx({t: v / mean for t, v in inv.items()})
    assert sum(weights.values()) / 2 == pytest.approx(1.0)
    assert float(weighting.loss(sums)) == pytest.approx((weights["caption"] * 7 + weights["text"] * 10) / 7)
    weighting.update({"text": (torch.tensor(2.0), 2)}, ["caption", "text"])
    assert weighting.averages == pytest.approx({"caption": 1.4, "text": 0.5 * 5 + 0.5 * 1})
    assert "caption: w" in weighting.describe()


def test_state_round_trip_and_bad_values():
    a = DynamicLossWeighting(beta=0.8)
    a.update(per_task_sums(*batch(), TASK_OF), ["caption", "text"])
    b = DynamicLossWeighting()
    b.load_state_dict(a.state_dict())
    assert b.weights() == a.weights() and b.beta == 0.8
    with pytest.raises(ValueError, match="beta=1.0 must be in"):
        DynamicLossWeighting(beta=1.0)
    with pytest.raises(ValueError, match="task 'text' is not among the configured tasks"):
        a.update(per_task_sums(*batch(), TASK_OF), ["caption"])


def dp_worker(rank: int, world_size: int) -> dict:
    """Each DP rank sees other tasks' samples; the all-reduced weights must agree."""
    import torch.distributed as dist

    weighting = DynamicLossWeighting(beta=0.5)
    local = {0: {"caption": (torch.tensor(9.0), 3)}, 1: {"caption": (torch.tensor(1.0), 1),
                                                           "text": (torch.tensor(8.0), 4)}}[rank]
    return weighting.update(local, ["caption", "text"], group=dist.group.WORLD)


def test_weights_agree_across_data_parallel_ranks():
    from megatron_cpu_harness import launch

    first, second = launch(dp_worker, 2)
    # over both ranks caption 10 / 4 = 2.5, text 8 / 4 = 2 (neither rank alone sees these)
    assert first == second == pytest.approx({"caption": 0.4 / 0.45, "text": 0.5 / 0.45})


def test_loss_weighting_api_weigh_uses_then_updates_the_weights():
    weighting = LossWeighting(("caption", "text"), beta=0.5)
    per_sample = torch.tensor([2.0, 4.0, 1.0], requires_grad=True)
    tokens = torch.tensor([3, 2, 5])
    loss, used = weighting.weigh(per_sample, ["caption", "text", "caption"], tokens)
    assert used == {"caption": 1.0, "text": 1.0}
    assert float(loss.detach()) == pytest.approx((2 * 3 + 4 * 2 + 1 * 5) / 10)  # the plain token mean
    # caption mean (6 + 5) / 8, text 8 / 2 -> inverses normalised to mean 1
    inv = {"caption": 8 / 11, "text": 1 / 4}
    expected = {t: v / ((inv["caption"] + inv["text"]) / 2) for t, v in inv.items()}
    assert weighting.weights() == pytest.approx(expected)
    loss, used = weighting.weigh(per_sample, ["caption", "text", "caption"], tokens)
    assert used == pytest.approx(expected)
    assert float(loss.detach()) == pytest.approx((expected["caption"] * 11 + expected["text"] * 8) / 10)
    loss.backward()  # the weights are constants: d loss / d loss_i = w_i * tokens_i / N
    grad = [expected[t] * n / 10 for t, n in zip(["caption", "text", "caption"], [3, 2, 5])]
    assert per_sample.grad.tolist() == pytest.approx(grad)
    # the samples' mean (tokens default to one per sample)
    mean, _ = LossWeighting(("a",)).weigh(torch.tensor([1.0, 3.0]), ["a", "a"])
    assert float(mean) == 2.0
    with pytest.raises(ValueError, match="2 sample losses but 1 tasks"):
        weighting.weigh(torch.tensor([1.0, 2.0]), ["text"])
    with pytest.raises(ValueError, match="task 'video' is not among the configured tasks"):
        weighting.weigh(torch.tensor([1.0]), ["video"])


def test_weigh_tokens_scales_each_token_by_its_samples_task():
    weighting = LossWeighting(("caption", "text"), beta=0.0)
    losses, labels, cu, ids = batch()
    tasks = [TASK_OF(s) for s in ids]
    first, _ = weighting.weigh_tokens(losses, labels, cu, tasks)
    assert torch.equal(first, losses)  # weights 1 before any update
    second, used = weighting.weigh_tokens(losses, labels, cu, tasks)
    w = {"caption": (5 / 7) / ((5 / 7 + 1 / 5) / 2), "text": (1 / 5) / ((5 / 7 + 1 / 5) / 2)}
    assert used == pytest.approx(w)
    per_token = [w["caption"]] * 4 + [w["text"]] * 3 + [w["caption"]] * 3
    assert second.reshape(-1).tolist() == pytest.approx((losses.reshape(-1) * torch.tensor(per_token)).tolist())
    # one sample per row (no cu_seqlens)
    sums, counts, _ = per_sample_sums(torch.ones(2, 3), torch.tensor([[1, 1, -100], [-100, 1, 1]]), None, 2)
    assert sums.tolist() == [2.0, 2.0] and counts.tolist() == [2, 2]
    with pytest.raises(ValueError, match="the batch has 2 row\\(s\\) but 3 sample_ids"):
        per_sample_sums(torch.ones(2, 3), torch.ones(2, 3), None, 3)


def test_state_of_the_api_round_trips_and_refuses_other_tasks():
    a = LossWeighting(("caption", "text"))
    a.weigh(torch.tensor([1.0, 3.0]), ["caption", "text"])
    b = LossWeighting(("caption", "text"))
    b.load_state_dict(a.state_dict())
    assert b.weights() == a.weights() and "caption: w" in b.describe()
    with pytest.raises(ValueError, match="state is for tasks \\['caption', 'text'\\], this run has \\['text'\\]"):
        LossWeighting(("text",)).load_state_dict(a.state_dict())


def test_flags_name_bad_values_and_unmatched_samples():
    from mindspeed_flow.config import FlowConfig, add_flow_arguments
    parser = add_flow_arguments(argparse.ArgumentParser(allow_abbrev=False))
    ns = parser.parse_args(["--flow-loss-weighting", "*caption*=caption", "*=text"])
    assert FlowConfig.from_namespace(ns, environ={}).enabled("recipes")
    config = loss_weighting_settings(ns.flow_loss_weighting, ns.flow_loss_weighting_beta)
    assert config.tasks == ("caption", "text") and config.beta == 0.9
    assert config.task_of()("d/caption-1.jsonl:4") == "caption" and config.task_of()("d/x.jsonl:0") == "text"
    assert loss_weighting_settings(None, 0.5) is None
    with pytest.raises(RecipeConfigError, match="--flow-loss-weighting: 'caption' is not PREFIX=VALUE"):
        loss_weighting_settings(["caption"], None)
    with pytest.raises(RecipeConfigError, match="--flow-loss-weighting-beta: 1.5 must be in"):
        loss_weighting_settings(["*=a"], 1.5)
    only_caption = loss_weighting_settings(["*caption*=caption"], None).task_of()
    with pytest.raises(ValueError, match="sample 'd/text-0.jsonl:7': its file 'd/text-0.jsonl' matches no"):
        only_caption("d/text-0.jsonl:7")


def steps():
    """Four microbatches of a caption and a text sample with changing losses."""
    return [(torch.tensor([2.0 + i, 4.0 - i]), torch.tensor([3, 5])) for i in range(4)]


def test_checkpoint_round_trip_continues_the_uninterrupted_weighting(tmp_path):
    uninterrupted = LossWeighting(("caption", "text"), beta=0.7)
    expected = [uninterrupted.weigh(loss, ["caption", "text"], tokens) for loss, tokens in steps()]
    first = LossWeighting(("caption", "text"), beta=0.7)
    for loss, tokens in steps()[:2]:
        first.weigh(loss, ["caption", "text"], tokens)
    torch.save({"flow_loss_weighting": first.state_dict()}, tmp_path / "model_optim_rng.pt")
    resumed = LossWeighting(("caption", "text"), beta=0.7)
    resumed.load_state_dict(torch.load(tmp_path / "model_optim_rng.pt", weights_only=True)["flow_loss_weighting"])
    assert resumed.weights() == first.weights() and resumed.weights() != {"caption": 1.0, "text": 1.0}
    for (loss, tokens), (want_loss, want_used) in zip(steps()[2:], expected[2:]):
        got_loss, got_used = resumed.weigh(loss, ["caption", "text"], tokens)
        assert got_used == want_used and float(got_loss) == float(want_loss)


@pytest.fixture
def patch_state():
    from mindspeed_flow.adapters.megatron import recipes as megatron_core_recipes
    from mindspeed_flow.adapters.mindspeed_mm import loss as mindspeed_mm_loss

    megatron_core_recipes.configure(argparse.Namespace(flow_loss_weighting=["*caption*=caption", "*text*=text"],
                                                       flow_loss_weighting_beta=0.5))
    mindspeed_mm_loss.reset()
    yield mindspeed_mm_loss
    mindspeed_mm_loss.reset()
    megatron_core_recipes.reset()


def test_checkpoint_patch_saves_and_restores_the_patch_weighting(patch_state):
    """The two checkpoint wrappers around stand-ins for Megatron's ``generate_state_dict`` and
    ``_load_base_checkpoint`` (``megatron.training`` is not installed in this venv; the real
    ones run in ``tests/upstream/test_upstream_loss_weighting.py``)."""
    from mindspeed_flow.adapters.megatron import checkpoint as extra

    def generate_state_dict(*args, **kwargs):  # stand-in for Megatron's
        return {"iteration": 1}

    assert extra.generate_state_dict_wrapper(generate_state_dict, None, (), {}) == {"iteration": 1}  # no weighting yet
    weighting = patch_state.current_weighting()
    weighting.weigh(torch.tensor([3.0, 1.0]), ["caption", "text"])
    saved = extra.generate_state_dict_wrapper(generate_state_dict, None, (), {})
    assert saved["flow_loss_weighting"] == weighting.state_dict()
    after_save = weighting.weights()

    def load(state):  # stand-in for Megatron's _load_base_checkpoint
        return lambda *args, **kwargs: (state, "ckpt/iter_0000001", False, None)

    resume_args = argparse.Namespace(finetune=False)
    patch_state.reset()
    # the rank0 peek at the metadata and --finetune leave the weighting alone
    extra.load_base_checkpoint_wrapper(load(saved), None, ("ckpt", resume_args), {"rank0": True})
    extra.load_base_checkpoint_wrapper(load(saved), None, ("ckpt", argparse.Namespace(finetune=True)), {})
    assert patch_state.current_weighting().weights() == {"caption": 1.0, "text": 1.0}
    patch_state.reset()
    result = extra.load_base_checkpoint_wrapper(load(saved), None, ("ckpt", resume_args), {})
    assert result[0] is saved
    assert patch_state.saved_state() == saved["flow_loss_weighting"]  # pending until the weighting is made
    assert patch_state.current_weighting().weights() == after_save
    # restoring into an existing weighting, and a checkpoint of other tasks
    patch_state.current_weighting().weigh(torch.tensor([1.0]), ["text"])
    extra.load_base_checkpoint_wrapper(load(saved), None, ("ckpt", resume_args), {})
    assert patch_state.current_weighting().weights() == after_save
    other = {**saved, "flow_loss_weighting": {**saved["flow_loss_weighting"], "tasks": ["text"]}}
    with pytest.raises(ValueError, match="checkpoint's loss-weighting state is for tasks \\['text'\\], this run has"):
        extra.load_base_checkpoint_wrapper(load(other), None, ("ckpt", resume_args), {})


def test_checkpoint_format_with_pipeline_stages_is_refused_by_name():
    from mindspeed_flow.adapters.mindspeed_mm.loss import _check_checkpoint_format

    _check_checkpoint_format(argparse.Namespace(save="ckpt", ckpt_format="torch"), 2)
    _check_checkpoint_format(argparse.Namespace(save="ckpt", ckpt_format="torch_dist"), 1)
    _check_checkpoint_format(argparse.Namespace(save=None, ckpt_format="torch_dist"), 2)
    with pytest.raises(NotImplementedError, match="2 stages\\) saves its state only in --ckpt-format torch"):
        _check_checkpoint_format(argparse.Namespace(save="ckpt", ckpt_format="torch_dist"), 2)
