"""MindSpeed-MM's language-model loss with dynamic per-task weights (feature ``recipes``,
``--flow-loss-weighting PATTERN=TASK ...``).

Upstream (MindSpeed-MM 57069cd): ``VLMModel.forward`` shifts logits and labels and calls
``compute_language_model_loss(logits, labels)`` (TP = 1) or
``compute_loss_with_tensor_parallel(logits, labels)`` (TP > 1); the result goes into
``loss_dict["loss"]``, which ``pretrain_vlm.loss_func`` reduces (the token mean of the
microbatch, or with ``--calculate-per-token-loss`` the per-token losses it sums over the step).
Neither loss method sees which sample a token belongs to.

Here ``VLMModel.forward`` keeps the batch's ``sample_ids`` (and its packing: the loader's
``cu_seqlens``, or the ``packed_seq_params`` made from them) for the duration of the call;
the two loss methods then compute the per-token cross entropy once and weight each token by
its sample's task weight (:class:`~mindspeed_flow.recipes.loss_weighting.LossWeighting`):
the token mean ``sum_t w_t S_t / N`` by default, the weighted per-token losses under
``--calculate-per-token-loss``.  Each microbatch's per-task sums then update the moving
averages, all-reduced over the data-parallel group, so the weights change from one
microbatch to the next and every DP rank holds the same ones.  Rank 0 of each DP group logs
the weights once per iteration.  Only in training (``model.training``); evaluation keeps
upstream's loss.  Nothing upstream is imported at module level.

The weighting's state goes into Megatron's checkpoint through
:mod:`~mindspeed_flow.adapters.megatron.checkpoint`, which reads it with
:func:`saved_state` and gives a loaded one back with :func:`restore_state` (kept pending
until the first weighted microbatch makes the weighting).
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any, Callable, Optional

import torch

from mindspeed_flow.recipes.loss_weighting import IGNORE, LossWeighting, per_sample_sums

from ..megatron import recipes
from .model import VLM_FORWARD_PARAMS, _argument

log = logging.getLogger(__name__)

LOSS_PARAMS = ("logits", "labels")
SAMPLE_IDS_KEY = "sample_ids"
CU_SEQLENS_KEY = "cu_seqlens"

# (sample_ids, cu_seqlens or None) of the VLMModel.forward call in progress.
_BATCH: contextvars.ContextVar[Optional[tuple[list[str], Optional[torch.Tensor]]]] = contextvars.ContextVar(
    "flow_loss_weighting_batch", default=None)
_weighting: Optional[LossWeighting] = None
_pending_state: Optional[dict[str, Any]] = None  # restored from a checkpoint before the weighting exists
_logged_iteration: Optional[int] = None


def current_weighting() -> Optional[LossWeighting]:
    """The run's weighting (made on first use, over Megatron's data-parallel group)."""
    global _weighting
    config = recipes.current_loss_weighting()
    if config is None:
        return None
    if _weighting is None:
        import torch.distributed as dist
        from megatron.core import mpu

        group = mpu.get_data_parallel_group() if dist.is_initialized() else None
        _weighting = LossWeighting(config.tasks, config.beta, group)
        if _pending_state is not None:
            _load_into(_weighting, _pending_state, config.beta)
    return _weighting


def saved_state() -> Optional[dict[str, Any]]:
    """What a checkpoint saves: the weighting's state (or the one restored and not used
    yet); ``None`` where this rank holds none (no weighting, or not the last stage)."""
    if recipes.current_loss_weighting() is None:
        return None
    return _weighting.state_dict() if _weighting is not None else _pending_state


def restore_state(state: dict[str, Any]) -> None:
    """Continue from a checkpoint's state: now if the weighting exists, else when it is made.
    Other tasks than the run's are refused (by :meth:`LossWeighting.load_state_dict`)."""
    global _pending_state
    config = recipes.current_loss_weighting()
    if config is None:
        return
    if list(state["tasks"]) != list(config.tasks):
        raise ValueError(f"--flow-loss-weighting: the checkpoint's loss-weighting state is for tasks "
                         f"{list(state['tasks'])}, this run has {list(config.tasks)}")
    _pending_state = dict(state)
    if _weighting is not None:
        _load_into(_weighting, _pending_state, config.beta)


def _load_into(weighting: LossWeighting, state: dict[str, Any], beta: float) -> None:
    """Load ``state``; the flag's momentum wins over the saved one (a changed flag is logged)."""
    global _pending_state
    weighting.load_state_dict(state)
    if weighting.rule.beta != beta:
        log.warning("--flow-loss-weighting-beta %s differs from the checkpoint's %s; using %s",
                    beta, weighting.rule.beta, beta)
        weighting.rule.beta = beta
    _pending_state = None
    log.info("mindspeed-flow loss weights restored from the checkpoint: %s", weighting.describe())


def reset() -> None:
    """Forget the weights (tests; a new job in the same process)."""
    global _weighting, _pending_state, _logged_iteration
    _weighting, _pending_state, _logged_iteration = None, None, None


def vlm_forward(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """``VLMModel.forward``: the batch's samples, visible to the loss methods during the call."""
    if current_weighting() is None or not instance.training:
        return wrapped(*args, **kwargs)
    from megatron.core import mpu
    from megatron.training import get_args

    sample_ids = kwargs.get(SAMPLE_IDS_KEY)
    if sample_ids is None:
        raise ValueError("--flow-loss-weighting: the batch has no 'sample_ids' to find each sample's task; "
                         "it needs the plugin's loader (--flow-packing)")
    if getattr(get_args(), "calculate_per_sample_loss", False):
        raise ValueError("--flow-loss-weighting weights tokens; it cannot be combined with --calculate-per-sample-loss")
    if mpu.get_context_parallel_world_size() > 1:
        raise NotImplementedError("--flow-loss-weighting does not support context parallelism in this version")
    _check_checkpoint_format(get_args(), mpu.get_pipeline_model_parallel_world_size())
    cu_seqlens = kwargs.get(CU_SEQLENS_KEY)
    packed = _argument(args, kwargs, VLM_FORWARD_PARAMS, "packed_seq_params")
    if cu_seqlens is None and packed is not None:
        cu_seqlens = packed.cu_seqlens_q
    token = _BATCH.set((list(sample_ids), cu_seqlens))
    try:
        return wrapped(*args, **kwargs)
    finally:
        _BATCH.reset(token)


def _check_checkpoint_format(margs: Any, pipeline_size: int) -> None:
    """Only the last pipeline stage holds the weighting; a distributed checkpoint keeps its
    common (non-tensor) entries from global rank 0, which is on the first stage when PP > 1."""
    if getattr(margs, "save", None) and pipeline_size > 1 and getattr(margs, "ckpt_format", "torch") != "torch":
        raise NotImplementedError(
            f"--flow-loss-weighting with pipeline parallelism ({pipeline_size} stages) saves its state only in "
            f"--ckpt-format torch checkpoints (each stage's own file), not in {margs.ckpt_format!r}")


def _weighted_loss(token_losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The microbatch's weighted loss from its (shifted) per-token losses ``[B, S]``."""
    from megatron.core import mpu
    from megatron.training import get_args

    sample_ids, cu_seqlens = _BATCH.get()
    weighting = current_weighting()
    tasks = [recipes.current_loss_weighting().task_of()(s) for s in sample_ids]
    # upstream drops each row's first label: shifted position j predicts token j + 1
    shifted = None if cu_seqlens is None else (torch.as_tensor(cu_seqlens).reshape(-1) - 1).clamp(min=0)
    margs = get_args()
    if margs.calculate_per_token_loss:
        loss, used = weighting.weigh_tokens(token_losses, labels, shifted, tasks)
    else:
        sums, counts, _ = per_sample_sums(token_losses, labels, shifted, len(tasks))
        loss, used = weighting.weigh_sums(sums, counts, tasks)
    _log_once_per_iteration(getattr(margs, "curr_iteration", None), mpu.get_data_parallel_rank(), used, weighting)
    return loss


def _log_once_per_iteration(iteration: Optional[int], dp_rank: int, used: dict[str, float],
                            weighting: LossWeighting) -> None:
    global _logged_iteration
    if dp_rank == 0 and (iteration != _logged_iteration or iteration is None):
        _logged_iteration = iteration
        log.info("mindspeed-flow loss weights (iteration %s): used %s; after this microbatch %s", iteration,
                 ", ".join(f"{t} {w:.4f}" for t, w in used.items()), weighting.describe())


def language_model_loss(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``VLMModel.compute_language_model_loss`` (TP = 1), weighted inside a weighted forward."""
    if _BATCH.get() is None:
        return wrapped(*args, **kwargs)
    logits, labels = (_argument(args, kwargs, LOSS_PARAMS, name) for name in LOSS_PARAMS)
    token_losses = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none", ignore_index=IGNORE)
    loss = _weighted_loss(token_losses.reshape(labels.shape), labels)
    return loss.reshape(-1) if loss.dim() else loss  # per-token: flattened, as upstream


def tensor_parallel_loss(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``VLMModel.compute_loss_with_tensor_parallel`` (TP > 1), weighted inside a weighted forward."""
    if _BATCH.get() is None:
        return wrapped(*args, **kwargs)
    from megatron.core import tensor_parallel

    logits, labels = (_argument(args, kwargs, LOSS_PARAMS, name) for name in LOSS_PARAMS)
    token_losses = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels) * (labels != IGNORE)
    return _weighted_loss(token_losses, labels)
