"""``--flow-loss-weighting`` on MindSpeed-MM's real ``VLMModel`` (tiny Qwen2.5-VL on CPU):
the patched loss of a packed caption + text batch equals upstream's per-token loss times each
token's task weight, the weights following the documented rule (inverse moving average of
each task's mean token loss, normalised to mean 1), recomputed here independently; and the weighting's state saved by Megatron's real
``save_checkpoint`` and restored by its ``load_checkpoint``, so a resumed job's next weighted
loss equals the uninterrupted one."""

from __future__ import annotations

from dataclasses import replace

import pytest

from conftest import FP32
from harness import HERE, run_upstream, sample_specs

TASK_FLAGS = ("--flow-fused-attn", "--flow-loss-weighting", "*caption*=caption", "*text*=text")


@pytest.fixture(scope="module")
def run(runs):
    """One subprocess; ``runs`` skips (or fails under CI) when MindSpeed-MM's dependencies are missing."""
    workdir = runs.root / "loss_weighting"
    job = replace(FP32, samples=sample_specs(2), layout="packed",
                  extra_args=("--save", str(workdir / "checkpoints"), "--save-interval", "1", "--ckpt-format", "torch"))
    return run_upstream(job, workdir, plugin=True, save_initial=False,
                        extra_plugin_flags=TASK_FLAGS, driver=HERE / "loss_weighting_driver.py").result


def task_of_tokens(result: dict) -> list[str]:
    """The task of each shifted position: the sample holding the token it predicts."""
    ends = result["cu_seqlens"][1:]
    return ["caption" if next(i for i, end in enumerate(ends) if j + 1 < end) == 0 else "text"
            for j in range(len(result["labels"]))]


def test_upstream_eval_loss_is_the_plain_cross_entropy(run):
    assert run["plain"] == pytest.approx(run["reference"], rel=1e-5, abs=1e-6)


def test_weighted_loss_follows_the_rule_on_the_real_model(run):
    tasks, plain, counted = task_of_tokens(run), run["plain"], [label != -100 for label in run["labels"]]
    assert {"caption", "text"} == {t for t, c in zip(tasks, counted) if c}
    # first training forward: no task seen yet, every weight 1 -> upstream's losses
    assert run["weighted"][0] == pytest.approx(plain, rel=1e-6, abs=1e-7)
    # after it each task's average is its mean token loss; weights = inverses, mean 1
    means = {task: sum(p for p, t, c in zip(plain, tasks, counted) if t == task and c)
             / sum(1 for t, c in zip(tasks, counted) if t == task and c) for task in ("caption", "text")}
    inverse = {task: 1 / m for task, m in means.items()}
    weights = {task: v / (sum(inverse.values()) / 2) for task, v in inverse.items()}
    assert abs(weights["caption"] - 1) > 1e-3  # the two tasks' losses differ: the weights do too
    expected = [p * weights[t] for p, t in zip(plain, tasks)]
    assert run["weighted"][1] == pytest.approx(expected, rel=1e-5, abs=1e-7)


def test_megatron_checkpoint_carries_the_weighting_and_a_resume_continues_it(run):
    saved = run["saved"]
    assert saved == run["before_save"] and saved["tasks"] == ["caption", "text"]
    assert set(saved["averages"]) == {"caption", "text"}  # both tasks seen: weights differ from 1
    assert run["loaded_iteration"] == 1
    uninterrupted_losses, uninterrupted_state = run["uninterrupted"]
    resumed_losses, resumed_state = run["resumed"]
    assert resumed_losses == uninterrupted_losses and resumed_state == uninterrupted_state
    # a resume that restarted the weights at 1 would give upstream's plain losses instead
    assert resumed_losses != pytest.approx(run["plain"], rel=1e-6, abs=1e-7)
