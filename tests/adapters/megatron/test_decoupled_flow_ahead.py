"""When a frozen ViT's encoder rank runs ahead into the next step in Megatron's job
(``adapters/megatron/decoupled_flow.py``): only when the job's next call is that training
step, and a step read ahead is never taken by a call it cannot be (an evaluation drops it).
The running itself, in ``pretrain_vlm.py``, is ``tests/upstream/test_real_job_flow.py``."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from mindspeed_flow.decoupled import DecoupledLayout
from mindspeed_flow.adapters.megatron import decoupled_flow
from mindspeed_flow.flow import EmbeddingProducer, EncoderCost, SampleMeta, group_step
from mindspeed_flow.flow.errors import StreamError
from mindspeed_flow.packing import CostModel
from mindspeed_flow.pool import open_pool


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
    ({"exit_interval": 3}, False),  # the job exits after iteration 3
    ({"exit_interval": 4}, True),
    ({"rerun_mode": "validate_results"}, False),  # Megatron may replay the step on a rewound iterator
    ({"mm": SimpleNamespace(model=SimpleNamespace(use_dynamic_dpcp=True))}, False),  # reads the iterator first
], ids=["middle", "before-last", "last", "no-loop", "before-eval", "no-eval-now", "no-valid", "rampup",
        "data-balance", "before-exit", "no-exit-now", "rerun", "dynamic-dpcp"])
def test_the_encoder_runs_ahead_only_into_the_next_training_step(overrides, expected):
    assert decoupled_flow.next_is_training_step(loop_args(**overrides)) is expected


class HeldStep:
    """A step's samples as :func:`decoupled_flow.run_ahead` holds them (its microbatches)."""

    def __init__(self, step: int, microbatches: int) -> None:
        self.step, self.loader_microbatches = step, [()] * microbatches


@pytest.mark.parametrize("slices, held", [(1, 4), (2, 8)])
def test_a_step_read_ahead_is_refused_to_a_training_step_of_another_count(monkeypatch, slices, held):
    """Counted a slice: a layout that deals over 2 slices held both slices' microbatches."""
    monkeypatch.setattr(decoupled_flow, "FLOW", decoupled_flow.FlowState(steps=4, ahead=(HeldStep(3, held), "grouping")))
    layout = DecoupledLayout(backbone_dp=slices, flow=True, flow_repack=True)
    with pytest.raises(StreamError) as refused:
        decoupled_flow.encoder_step(layout, iter(()), 2, forward_only=False)
    assert str(refused.value).startswith("decoupled.flow: the encoder ran ahead into step 3 (4 microbatches a slice), "
                                         "but the job's next training step has 2 microbatches")


def test_an_evaluation_where_the_step_read_ahead_was_expected_drops_it(monkeypatch):
    """MindSpeed-MM's last validation after a sample budget shortened ``train_iters`` (the
    encoder ran ahead before it shrank): the held step's entries leave the (real, local)
    pool, and the evaluation takes its number, as on the backbone."""
    pool = open_pool("local", capacity_bytes=1 << 12, name=f"dropahead{os.getpid()}", owner="p0")
    samples = [SampleMeta(i, 3, 8, 1, (4,)) for i in range(2)]
    grouping = group_step(samples, capacity=16, llm_cost=CostModel(), encoder_cost=EncoderCost(linear=1.0),
                          encoder_budget=4.0, microbatches=2)
    producer = EmbeddingProducer(pool, lambda metas: torch.zeros(len(metas), 2), replica=0, trainable=False,
                                 timeout_s=2.0)
    producer.run_ahead(grouping)
    keys = [str(m.key("act")) for m in samples]
    assert all(pool.ready(k) for k in keys)
    monkeypatch.setattr(decoupled_flow, "FLOW", decoupled_flow.FlowState(
        steps=4, producer=producer, samples={3: "held"}, ahead=(HeldStep(3, 2), grouping)))
    seen = []
    monkeypatch.setattr(decoupled_flow, "step_grouping",
                        lambda layout, iterator, n: seen.append(decoupled_flow.FLOW.steps) or ("eval", n))
    assert decoupled_flow.encoder_step(None, iter(()), 2, forward_only=True) == ("eval", 2)
    assert seen == [3] and decoupled_flow.FLOW.ahead is None and decoupled_flow.FLOW.samples == {}
    assert not any(pool.ready(k) for k in keys)
    pool.close()


def test_the_step_read_ahead_is_the_next_call_s_without_reading_the_iterator(monkeypatch):
    held = HeldStep(3, 4)
    monkeypatch.setattr(decoupled_flow, "FLOW", decoupled_flow.FlowState(steps=4, ahead=(held, "grouping")))
    assert decoupled_flow.encoder_step(DecoupledLayout(flow=True), iter(()), 4, forward_only=False) == (held, "grouping")
    assert decoupled_flow.FLOW.ahead is None and decoupled_flow.FLOW.steps == 4
