"""MindSpeed-MM's train step with the consumed-sample count of packed microbatches (feature ``packing``).

Upstream (``mindspeed_mm/training.py``, 57069cd) assumes one sample per microbatch row:

* ``train_step`` advances the LR scheduler by
  ``increment = num_microbatches * micro_batch_size * data_parallel_size``;
* ``train``, right after ``train_step`` returns, adds
  ``data_parallel_world_size * micro_batch_size * num_microbatches`` to
  ``args.consumed_train_samples``.

:func:`train_step_real_samples` wraps ``train_step``: the scheduler it hands upstream
only notes the ``step(increment=...)`` call; once the step is over it closes the step's
accounting (:mod:`mindspeed_flow.data.accounting`: one all-reduce, every rank), advances
the real scheduler by :func:`~mindspeed_flow.data.accounting.scheduler_increment`, adds to
``consumed_train_samples`` the difference between the real count and the nominal one the
loop is about to add, and keeps ``args.consumed_train_tokens``.  With ``--train-samples``
the run ends once that many real samples were consumed (``args.train_iters`` becomes the
current step + 1; the loop's own bound ``train_samples // global_batch_size`` steps is an
upper bound, reached only if every pack held a single sample).  Nothing upstream is
imported at module level.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import wrapt

from mindspeed_flow.data.accounting import ACCOUNTING, consumed_correction, scheduler_increment

from .model import _argument, _with_argument

logger = logging.getLogger(__name__)

TRAIN_STEP_PARAMS = (
    "forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler", "config", "call_backs",
)


class DeferredSchedulerStep(wrapt.ObjectProxy):
    """The LR scheduler as upstream's ``train_step`` sees it: ``step(increment)`` is noted,
    not run, because the real increment is known only after the step's all-reduce.  Every
    other attribute is the real scheduler's."""

    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler)
        self._self_increment: int | None = None

    def step(self, increment: int) -> None:
        self._self_increment = increment

    @property
    def noted_increment(self) -> int | None:
        return self._self_increment


def train_step_real_samples(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``mindspeed_mm.training.train_step`` counting the samples its microbatches really held."""
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args

    margs = get_args()
    if getattr(margs, "use_txt_dynamic_batching", False):
        raise ValueError("packing: --use-txt-dynamic-batching counts samples through its own dataloader; "
                         "it cannot be combined with the packing loader")
    scheduler = _argument(args, kwargs, TRAIN_STEP_PARAMS, "opt_param_scheduler")
    deferred = None if scheduler is None else DeferredSchedulerStep(scheduler)
    if deferred is not None:
        args, kwargs = _with_argument(args, kwargs, TRAIN_STEP_PARAMS, "opt_param_scheduler", deferred)
    result = wrapped(*args, **kwargs)

    totals = ACCOUNTING.close_step()
    if not totals.microbatches:
        logger.warning("packing: no microbatch of this step was recorded by the packing loader; "
                       "consumed samples keep MindSpeed-MM's count (dp * micro_batch_size * num_microbatches)")
    nominal = mpu.get_data_parallel_world_size() * margs.micro_batch_size * get_num_microbatches()
    sample_based = getattr(margs, "train_samples", None) is not None
    if deferred is not None and deferred.noted_increment is not None:
        scheduler.step(increment=scheduler_increment(deferred.noted_increment, totals, sample_based))
    margs.consumed_train_samples += consumed_correction(nominal, totals)  # the loop adds `nominal` next
    margs.consumed_train_tokens = getattr(margs, "consumed_train_tokens", 0) + totals.tokens
    if sample_based and totals.microbatches and margs.consumed_train_samples + nominal >= margs.train_samples:
        margs.train_iters = margs.curr_iteration + 1  # the budget of real samples is spent: last step
    return result
