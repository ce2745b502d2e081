"""When a frozen ViT's encoder rank runs ahead into the next step in Megatron's job
(``adapters/megatron/decoupled_flow.py``): only when the job's next call is that training
step, and a step read ahead is never taken by a call it cannot be.  The running itself, in
``pretrain_vlm.py``, is ``tests/upstream/test_real_job_flow.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mindspeed_flow.adapters.megatron import decoupled_flow
from mindspeed_flow.flow.errors import StreamError


def loop_args(**overrides) -> SimpleNamespace:
    """MindSpeed-MM's ``train`` loop's arguments during iteration ``curr_iteration`` (0-based)."""
    values = dict(curr_iteration=2, train_iters=8, do_valid=False, eval_interval=None, rampup_batch_size=None,
                  use_data_balance=False)
    values.update(overrides)
    return SimpleNamespace(**values)


@pytest.mark.parametrize("overrides, expected", [
    ({}, True),
    ({"curr_iteration": 6}, True),  # iteration 7 of 8 follows
    ({"curr_iteration": 7}, False),  # the last iteration: nothing follows
    ({"curr_iteration": None}, False),  # not MindSpeed-MM's loop (a driver's single step)
    ({"do_valid": True, "eval_interval": 3}, False),  # an evaluation follows iteration 3
    ({"do_valid": True, "eval_interval": 4}, True),
    ({"do_valid": False, "eval_interval": 3}, True),  # no validation set: no evaluation
    ({"rampup_batch_size": [4, 4, 100]}, False),  # the next step's microbatch count may change
    ({"use_data_balance": True}, False),  # the iterator is rebuilt every step
], ids=["middle", "before-last", "last", "no-loop", "before-eval", "no-eval-now", "no-valid", "rampup",
        "data-balance"])
def test_the_encoder_runs_ahead_only_into_the_next_training_step(overrides, expected):
    assert decoupled_flow.next_is_training_step(loop_args(**overrides)) is expected


class HeldStep:
    """A step's samples as :func:`decoupled_flow.run_ahead` holds them (its microbatches)."""

    def __init__(self, step: int, microbatches: int) -> None:
        self.step, self.microbatches = step, [()] * microbatches


@pytest.mark.parametrize("forward_only, microbatches, wanted", [
    (True, 4, "an evaluation of 4 microbatches"),
    (False, 2, "a training step of 2 microbatches"),
])
def test_a_step_read_ahead_is_refused_to_a_call_it_cannot_be(monkeypatch, forward_only, microbatches, wanted):
    monkeypatch.setattr(decoupled_flow, "FLOW", decoupled_flow.FlowState(steps=4, ahead=(HeldStep(3, 4), "grouping")))
    with pytest.raises(StreamError) as refused:
        decoupled_flow.encoder_step(None, iter(()), microbatches, forward_only=forward_only)
    assert str(refused.value).startswith("decoupled.flow: the encoder ran ahead into step 3 (4 microbatches, "
                                         f"training), but the job's next call is {wanted}")


def test_the_step_read_ahead_is_the_next_call_s_without_reading_the_iterator(monkeypatch):
    held = HeldStep(3, 4)
    monkeypatch.setattr(decoupled_flow, "FLOW", decoupled_flow.FlowState(steps=4, ahead=(held, "grouping")))
    assert decoupled_flow.encoder_step(None, iter(()), 4, forward_only=False) == (held, "grouping")
    assert decoupled_flow.FLOW.ahead is None and decoupled_flow.FLOW.steps == 4
