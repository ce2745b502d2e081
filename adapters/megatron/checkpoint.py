"""The dynamic loss weighting's state in Megatron's checkpoint (feature ``recipes``, only
with ``--flow-loss-weighting``), so a resumed job continues with the same weights.

Upstream (Megatron-LM core_v0.12.1, the copy inside MindSpeed-MM;
``megatron.training.checkpointing``): ``save_checkpoint`` builds what it writes with
``generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, ...)``;
``load_checkpoint`` reads it with ``_load_base_checkpoint(load_dir, args, rank0=False,
sharded_state_dict=None, checkpointing_context=None)`` (MindSpeed-MM's LoRA patch wraps the
same function).  Both are looked up as module globals, so wrapping them needs no copy of
either.  The megatron-core wheel has no ``megatron.training``: there is nothing to patch.

* Save: the returned state dict gains ``flow_loss_weighting`` (tasks, momentum, moving
  averages: a few floats) on the ranks that hold a weighting.  Every DP rank's weighting is
  the same (its statistics are all-reduced over the data-parallel group), so the one copy
  that Megatron writes per model-parallel rank (``mp_rank_XX`` files are written by DP rank
  0; a ``torch_dist`` checkpoint keeps rank 0's common entries) is the whole state.  Only the
  last pipeline stage computes the loss, so only its files carry it; with PP > 1 that needs
  ``--ckpt-format torch`` (refused otherwise at the first weighted step).
* Load: after the real load (not the ``rank0=True`` peek at the metadata) the entry is
  handed to :func:`~mindspeed_flow.adapters.mindspeed_mm.loss.restore_state`, unless
  ``--finetune`` (which restarts the optimizer and the schedule too: the weights restart at
  1).  A last-stage rank whose checkpoint has no entry (saved without the flag) logs that the
  weights start at 1.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from . import recipes
from ..mindspeed_mm import loss as mindspeed_mm_loss
from ..mindspeed_mm.model import _argument

log = logging.getLogger(__name__)

STATE_KEY = "flow_loss_weighting"
LOAD_PARAMS = ("load_dir", "args", "rank0", "sharded_state_dict", "checkpointing_context")


def generate_state_dict_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> dict:
    """``generate_state_dict``: Megatron's state dict plus this rank's weighting state."""
    state_dict = wrapped(*args, **kwargs)
    extra = mindspeed_mm_loss.saved_state()
    if extra is not None:
        state_dict[STATE_KEY] = extra
    return state_dict


def load_base_checkpoint_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``_load_base_checkpoint``: restore the weighting from what was loaded."""
    result = wrapped(*args, **kwargs)
    if recipes.current_loss_weighting() is None or _argument(args, kwargs, LOAD_PARAMS, "rank0"):
        return result
    state_dict, checkpoint_name = result[0], result[1]
    if state_dict is None or getattr(_argument(args, kwargs, LOAD_PARAMS, "args"), "finetune", False):
        return result
    if STATE_KEY in state_dict:
        mindspeed_mm_loss.restore_state(state_dict[STATE_KEY])
    elif _on_last_stage():
        log.warning("checkpoint %s has no loss-weighting state (saved without --flow-loss-weighting): "
                    "the weights start at 1", checkpoint_name)
    return result


def _on_last_stage() -> bool:
    from megatron.core import mpu

    return mpu.is_pipeline_last_stage(ignore_virtual=True)
