"""Dynamic loss weighting on loader-shaped packed batches: per-task sums from ``sample_ids``
and ``cu_seqlens``, the inverse-moving-average rule, equal weights = the plain mean, and the
resumable state."""

from __future__ import annotations

import pytest
import torch

from mindspeed_flow.recipes.loss_weighting import DynamicLossWeighting, per_task_sums, task_by_file

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
