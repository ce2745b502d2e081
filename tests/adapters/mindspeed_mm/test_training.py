"""Consumed samples of packed microbatches (feature ``packing``), against the pinned MindSpeed-MM.

MindSpeed-MM cannot be installed here, and its ``train`` loop needs an NPU job around it;
what the tests take from the pinned source (unpacked by ``unpack.sh``) is every piece that
decides the count: the patch target (``doctor --src``'s check; the CLI itself runs over all
patches in ``test_doctor``), upstream's own two count
expressions (the scheduler increment inside ``train_step`` and the ``batch_size`` the loop
adds after it, read with :mod:`ast` and evaluated on the real Megatron state), Megatron's
real ``global_vars``, ``parallel_state``, microbatch calculator and
``OptimizerParamScheduler`` from the pinned tree, over gloo with two DP ranks.  The one
stand-in is the body of ``train_step`` (named so below): it pulls the step's microbatches
and advances the scheduler with upstream's increment, which is all of it that counts.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_cpu_harness import launch
from mindspeed_flow.data.accounting import ConsumedAccounting, StepTotals, consumed_correction, scheduler_increment
from mindspeed_flow.doctor import check_sources
from mindspeed_flow.patches import packing_accounting
from pinned_upstream import upstream_sources


@pytest.fixture(scope="module")
def mindspeed_mm_root() -> Path:
    return upstream_sources().mindspeed_mm


def upstream_count_expressions(training_py: Path) -> dict[str, str]:
    """Upstream's per-step counts, as source text: ``increment`` (what ``train_step`` gives
    the scheduler) and ``batch_size`` (what ``train`` adds to ``consumed_train_samples``
    after ``train_step`` returns, outside ``--use-txt-dynamic-batching``)."""
    tree = ast.parse(training_py.read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}

    def assigned(function: ast.FunctionDef, name: str) -> list[ast.expr]:
        return [node.value for node in ast.walk(function) if isinstance(node, ast.Assign)
                and [ast.unparse(t) for t in node.targets] == [name]]

    (increment,) = assigned(functions["train_step"], "increment")
    steps = [node for node in ast.walk(functions["train_step"]) if isinstance(node, ast.Call)
             and ast.unparse(node.func) == "opt_param_scheduler.step"]
    assert [ast.unparse(k) for s in steps for k in s.keywords] == ["increment=increment"], "scheduler call changed"
    batch_sizes = [e for e in assigned(functions["train"], "batch_size") if "all_gather" not in ast.dump(e)]
    nominal = [e for e in batch_sizes if "get_num_microbatches" in ast.unparse(e)]
    assert len(nominal) == 1, [ast.unparse(e) for e in batch_sizes]
    adds = [node for node in ast.walk(functions["train"]) if isinstance(node, ast.AugAssign)
            and ast.unparse(node.target) == "args.consumed_train_samples"]
    assert [ast.unparse(a.value) for a in adds] == ["batch_size"], "the loop's count changed"
    return {"increment": ast.unparse(increment), "batch_size": ast.unparse(nominal[0])}


def test_doctor_src_finds_the_train_step_target(mindspeed_mm_root):
    """What ``mindspeed-flow doctor --src`` reports for this patch (its check, run in-process)."""
    (row,) = check_sources(packing_accounting.PATCHES, [mindspeed_mm_root])
    assert (row.status, row.target) == ("found", "mindspeed_mm.training:train_step")
    assert row.detail.endswith("mindspeed_mm/training.py:736")


def test_upstream_counts_one_sample_per_microbatch_row(mindspeed_mm_root):
    """The premise of the patch, read from the source: both counts are dp * mbs * microbatches."""
    expressions = upstream_count_expressions(mindspeed_mm_root / "mindspeed_mm" / "training.py")
    world = SimpleNamespace(get_data_parallel_world_size=lambda: 3)
    scope = {"args": SimpleNamespace(micro_batch_size=2, data_parallel_size=3), "mpu": world,
             "get_num_microbatches": lambda: 5}
    assert {name: eval(text, scope) for name, text in expressions.items()} == {"increment": 30, "batch_size": 30}


def test_count_rules():
    packed = StepTotals(samples=37, tokens=9000, microbatches=8)
    assert consumed_correction(8, packed) == 29
    assert scheduler_increment(8, packed, sample_based=True) == 37
    assert scheduler_increment(8, packed, sample_based=False) == 8  # --train-iters: a schedule in steps
    unrecorded = StepTotals()
    assert consumed_correction(8, unrecorded) == 0 and scheduler_increment(8, unrecorded, sample_based=True) == 8
    with pytest.raises(ValueError, match="-1 samples"):
        ConsumedAccounting().record(-1, 10)


def close_step_worker(rank: int, world_size: int) -> StepTotals:
    """Ranks 0 and 2 each decode for a replica; rank 1 stands for a TP peer of rank 0 that
    got its batches by broadcast and records nothing."""
    accounting = ConsumedAccounting()
    if rank != 1:
        for samples in ([3, 5] if rank == 0 else [7]):
            accounting.record(samples, 100 * samples)
    first = accounting.close_step()
    second = accounting.close_step()  # a closed step starts the next one from zero
    return first, second, accounting.pending


def test_close_step_counts_each_recording_rank_once_on_every_rank():
    results = launch(close_step_worker, 3, timeout_s=120)
    for first, second, pending in results:
        assert first == StepTotals(samples=15, tokens=1500, microbatches=3)
        assert second == StepTotals() and pending == StepTotals()


# Packs per rank and microbatch (2 DP ranks x 2 microbatches per step): samples per pack.
PACKS = {0: [3, 5, 2, 4, 6, 1, 2, 2], 1: [1, 6, 4, 4, 3, 3, 5, 2]}
TOKENS_PER_SAMPLE = 10


def train_loop_worker(rank: int, world_size: int, root: str, expressions: dict[str, str],
                      modes: dict[str, tuple[int | None, int | None]]) -> dict:
    """Upstream's counting around ``train_step``, wrapped by the patch, on the pinned Megatron;
    one run per mode (``train_iters``, ``train_samples``)."""
    sys.path.insert(0, root)  # the pinned tree: Megatron core_v0.12.1 with megatron.training
    import torch
    import wrapt
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator, get_num_microbatches, init_num_microbatches_calculator)
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.training.global_vars import set_args

    from megatron_cpu_harness import megatron_parallel
    from mindspeed_flow.adapters.mindspeed_mm.training import train_step_real_samples
    from mindspeed_flow.data.accounting import record_microbatch

    assert mpu.__file__.startswith(root)

    def run(train_iters: int | None, train_samples: int | None) -> dict:
        args = SimpleNamespace(micro_batch_size=1, data_parallel_size=world_size, consumed_train_samples=0,
                               train_samples=train_samples, train_iters=train_iters, curr_iteration=0,
                               use_txt_dynamic_batching=False)
        if train_samples is not None:  # Megatron's update_train_iters
            args.train_iters = train_samples // (world_size * 2)
        set_args(args)

        def packing_loader():  # stand-in for the loader: records each microbatch it hands out
            for samples in PACKS[rank]:
                record_microbatch(samples, samples * TOKENS_PER_SAMPLE)
                yield {"sample_ids": list(range(samples))}

        def train_step_stand_in(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config,
                                call_backs):
            for _ in range(get_num_microbatches()):  # what forward_backward_func pulls
                next(data_iterator)
            increment = eval(expressions["increment"], {"args": args, "get_num_microbatches": get_num_microbatches})
            opt_param_scheduler.step(increment=increment)

        init_num_microbatches_calculator(rank, None, world_size * 2, 1, world_size)
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        scheduler = OptimizerParamScheduler(optimizer, init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0,
                                            lr_decay_steps=1000, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                            wd_incr_steps=1, wd_incr_style="constant")
        train_step = wrapt.FunctionWrapper(train_step_stand_in, train_step_real_samples)
        data = packing_loader()
        iteration = 0
        counts = []
        while iteration < args.train_iters:  # upstream's loop, as far as it counts
            args.curr_iteration = iteration
            train_step(None, data, [], optimizer, scheduler, None, None)
            iteration += 1
            batch_size = eval(expressions["batch_size"], {"args": args, "mpu": mpu,
                                                          "get_num_microbatches": get_num_microbatches})
            args.consumed_train_samples += batch_size
            counts.append(args.consumed_train_samples)
        destroy_num_microbatches_calculator()
        return {"counts": counts, "tokens": args.consumed_train_tokens, "scheduler_steps": scheduler.num_steps,
                "iterations": iteration}

    with megatron_parallel():
        return {mode: run(*settings) for mode, settings in modes.items()}


def real_counts(steps: int) -> list[int]:
    per_step = [sum(PACKS[r][2 * s] + PACKS[r][2 * s + 1] for r in PACKS) for s in range(steps)]
    return [sum(per_step[: s + 1]) for s in range(steps)]


def test_train_step_counts_real_samples_across_dp(mindspeed_mm_root):
    expressions = upstream_count_expressions(mindspeed_mm_root / "mindspeed_mm" / "training.py")
    expected = real_counts(4)  # 4 steps: [15, 29, 42, 53] real samples against 4 per step nominal
    assert expected == [15, 29, 42, 53]
    # --train-iters 3; --train-samples 40: the budget of real samples is spent after step 3
    # (42 >= 40), not after the 10 steps of 4 nominal samples Megatron derives from it.
    modes = {"train_iters": (3, None), "train_samples": (None, 40)}
    results = launch(train_loop_worker, 2, str(mindspeed_mm_root), expressions, modes, timeout_s=240)
    for result in results:
        for mode, run in result.items():
            assert run["counts"] == expected[:3], mode
            assert run["iterations"] == 3, mode
            assert run["tokens"] == expected[2] * TOKENS_PER_SAMPLE, mode
        # --train-iters: the schedule stays in steps (4 nominal samples each); --train-samples: real samples.
        assert result["train_iters"]["scheduler_steps"] == 4 * 3
        assert result["train_samples"]["scheduler_steps"] == expected[2]
