"""Dynamic per-task loss weighting: each task's weight follows its recent loss.

Rule (documented, deterministic): per task ``t`` an exponential moving average of its mean
token loss, ``m_t <- beta * m_t + (1 - beta) * L_t`` (the first observation sets ``m_t``);
the weights are the inverses, normalised to mean 1 over the tasks seen so far::

    w_t = (1 / m_t) / mean_s(1 / m_s)

So a task whose loss is large for its scale is down-weighted and the tasks' contributions
even out; an unseen task has weight 1.  The step's loss is the token-weighted sum
``sum_t w_t * S_t / N`` (``S_t``: the summed token loss of task ``t``, ``N``: all counted
tokens), which is the plain token mean when every weight is 1.  The weights used in a step
are those from before it (its own loss updates them for the next), and they are detached.

Which task a sample belongs to comes from the loader's ``sample_ids`` (``file:line``): a
``task_of`` function maps the id to a task, e.g. :func:`task_by_file` from the source file's
name.  The statistics can be all-reduced over the data-parallel group so every rank uses
the same weights.

:class:`LossWeighting` is the API a training loop calls (the plugin's own loop, and the
``recipes`` patch of MindSpeed-MM's ``VLMModel`` loss)::

    weighting = LossWeighting(tasks=("caption", "text"), beta=0.9, group=dp_group)
    loss, weights = weighting.weigh(per_sample_loss, tasks, tokens)   # weights used, then updated
    log.info("loss weights: %s", weighting.describe())

``state_dict`` / ``load_state_dict`` carry the tasks, the momentum and the averages; the
``recipes`` patch saves them in Megatron's checkpoint and restores them on load.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .errors import RecipeConfigError
from .module_lr import parse_assignments

IGNORE = -100


def task_by_file(patterns: Mapping[str, str], default: str | None = "default") -> Callable[[str], str]:
    """``task_of`` from ``{glob on the source file name: task}``, first match wins; with
    ``default=None`` a sample no pattern matches is an error naming it."""
    def task_of(sample_id: str) -> str:
        file = sample_id.rsplit(":", 1)[0]
        task = next((task for pattern, task in patterns.items() if fnmatch.fnmatch(file, pattern)), default)
        if task is None:
            raise ValueError(f"sample {sample_id!r}: its file {file!r} matches no loss-weighting pattern "
                             f"({', '.join(patterns)})")
        return task
    return task_of


def per_sample_sums(token_losses: torch.Tensor, labels: torch.Tensor,
                    cu_seqlens: torch.Tensor | None, samples: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(summed token loss, counted tokens, sample of each token)`` per sample of a microbatch.

    ``token_losses`` / ``labels`` are ``[B, T]`` (or ``[T]``): a packed row (``B = 1``,
    samples cut by ``cu_seqlens``) or one sample per row (``cu_seqlens`` ``None``).  Tokens
    whose label is -100 are not counted.  A padded pack's last segment is its padding
    (``cu_seqlens`` one entry longer, every label -100, see :mod:`mindspeed_flow.data.batch`):
    it belongs to no sample.  The sums keep their gradient.
    """
    losses, mask = token_losses.reshape(-1), labels.reshape(-1) != IGNORE
    if cu_seqlens is None:
        rows = token_losses.shape[0] if token_losses.dim() > 1 else 1
        if rows != samples:
            raise ValueError(f"the batch has {rows} row(s) but {samples} sample_ids (and no cu_seqlens)")
        owner = torch.arange(rows, device=losses.device).repeat_interleave(losses.numel() // rows)
    else:
        bounds = torch.as_tensor(cu_seqlens).reshape(-1).to(losses.device, torch.int64)
        if len(bounds) == samples + 2 and not bool(mask[int(bounds[-2]):].any()):
            bounds = torch.cat([bounds[:-2], bounds[-1:]])  # padding joins the last sample, masked: counts nowhere
        if len(bounds) != samples + 1:
            raise ValueError(f"cu_seqlens has {len(bounds) - 1} segments but the batch has {samples} sample_ids")
        owner = torch.repeat_interleave(torch.arange(samples, device=losses.device), bounds[1:] - bounds[:-1],
                                        output_size=losses.numel())
    sums = losses.new_zeros(samples).index_add(0, owner, torch.where(mask, losses, losses.new_zeros(())))
    counts = torch.zeros(samples, dtype=torch.int64, device=losses.device).index_add(0, owner, mask.long())
    return sums, counts, owner


def per_task_sums(token_losses: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor | None,
                  sample_ids: Sequence[str], task_of: Callable[[str], str]) -> dict[str, tuple[torch.Tensor, int]]:
    """``{task: (summed token loss, counted tokens)}`` of one microbatch (see :func:`per_sample_sums`)."""
    sums, counts, _ = per_sample_sums(token_losses, labels, cu_seqlens, len(sample_ids))
    return group_by_task(sums, counts, [task_of(s) for s in sample_ids])


def group_by_task(sums: torch.Tensor, counts: torch.Tensor, tasks: Sequence[str]) -> dict[str, tuple[torch.Tensor, int]]:
    grouped: dict[str, tuple[torch.Tensor, int]] = {}
    for i, task in enumerate(tasks):
        total, count = grouped.get(task, (sums.new_zeros(()), 0))
        grouped[task] = (total + sums[i], count + int(counts[i]))
    return grouped


@dataclass(frozen=True)
class LossWeightingConfig:
    """``--flow-loss-weighting PATTERN=TASK ...`` and ``--flow-loss-weighting-beta``."""

    patterns: dict[str, str]
    beta: float = 0.9

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.patterns.values()))

    def task_of(self) -> Callable[[str], str]:
        return task_by_file(self.patterns, default=None)

    def describe(self) -> str:
        return ", ".join(f"{pattern} -> {task}" for pattern, task in self.patterns.items()) + f" (beta {self.beta})"


def loss_weighting_settings(entries: Sequence[str] | None, beta: float | None) -> LossWeightingConfig | None:
    """The weighting the flags ask for (``None``: off); a bad value raises naming the flag."""
    if not entries:
        return None
    patterns = parse_assignments(entries, "--flow-loss-weighting", str, bool, "a task name")
    beta = 0.9 if beta is None else float(beta)
    if not 0.0 <= beta < 1.0:
        raise RecipeConfigError(f"--flow-loss-weighting-beta: {beta} must be in [0, 1)")
    return LossWeightingConfig(patterns, beta)


@dataclass
class DynamicLossWeighting:
    """The moving averages and the weights; ``state_dict`` makes a resumed run identical."""

    beta: float = 0.9
    averages: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.beta < 1.0:
            raise ValueError(f"loss weighting momentum beta={self.beta} must be in [0, 1)")

    def weights(self) -> dict[str, float]:
        if not self.averages:
            return {}
        inverse = {t: 1.0 / max(m, 1e-12) for t, m in self.averages.items()}
        mean = sum(inverse.values()) / len(inverse)
        return {t: v / mean for t, v in inverse.items()}

    def loss(self, sums: Mapping[str, tuple[torch.Tensor, int]]) -> torch.Tensor:
        """The weighted step loss with the current weights."""
        weights = self.weights()
        total = sum(count for _, count in sums.values())
        if total == 0:
            return next(iter(sums.values()))[0] * 0.0 if sums else torch.zeros(())
        return sum(weights.get(t, 1.0) * s for t, (s, _) in sums.items()) / total

    def update(self, sums: Mapping[str, tuple[torch.Tensor, int]], tasks: Sequence[str],
               group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """Fold this step's mean task losses into the averages; returns the new weights.

        ``tasks`` lists every task in a fixed order (the same on every rank) so the
        all-reduce over ``group`` (when given) matches entries.
        """
        stats = torch.zeros(len(tasks), 2, dtype=torch.float64)
        unknown = sorted(set(sums) - set(tasks))
        if unknown:
            raise ValueError(f"task {unknown[0]!r} is not among the configured tasks {list(tasks)}")
        for i, task in enumerate(tasks):
            if task in sums:
                stats[i, 0], stats[i, 1] = float(sums[task][0].detach()), sums[task][1]
        if group is not None:
            dist.all_reduce(stats, group=group)
        for i, task in enumerate(tasks):
            total, count = float(stats[i, 0]), float(stats[i, 1])
            if count == 0 or not math.isfinite(total):
                continue
            mean = total / count
            old = self.averages.get(task)
            self.averages[task] = mean if old is None else self.beta * old + (1 - self.beta) * mean
        return self.weights()

    def describe(self) -> str:
        return ", ".join(f"{t}: w {w:.3f} (avg loss {self.averages[t]:.4f})" for t, w in sorted(self.weights().items()))

    def state_dict(self) -> dict[str, Any]:
        return {"beta": self.beta, "averages": dict(self.averages)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.beta, self.averages = float(state["beta"]), dict(state["averages"])


class LossWeighting:
    """Dynamic per-task loss weights for a training loop: weigh a microbatch's losses with the
    current weights, then fold its statistics in (all-reduced over ``group`` when given).

    ``tasks`` lists every task the run can meet, in the same order on every rank (it keys
    the all-reduce).  Weights of tasks not seen yet are 1.
    """

    def __init__(self, tasks: Sequence[str], beta: float = 0.9, group: dist.ProcessGroup | None = None) -> None:
        if not tasks or len(set(tasks)) != len(tasks):
            raise ValueError(f"loss weighting needs distinct task names, got {list(tasks)}")
        self.tasks, self.group = tuple(tasks), group
        self.rule = DynamicLossWeighting(beta=beta)

    def weights(self) -> dict[str, float]:
        current = self.rule.weights()
        return {task: current.get(task, 1.0) for task in self.tasks}

    def weigh(self, per_sample_loss: torch.Tensor, tasks: Sequence[str],
              tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """``(sum_i w(task_i) * loss_i * tokens_i / sum_i tokens_i, weights used)``.

        ``per_sample_loss``: each sample's mean token loss; ``tokens``: its counted tokens
        (default 1 each: the mean over samples).  With all weights 1 this is the plain
        token-weighted mean.  The weights are those from before the call.
        """
        if len(tasks) != per_sample_loss.numel():
            raise ValueError(f"{per_sample_loss.numel()} sample losses but {len(tasks)} tasks")
        counts = torch.ones_like(per_sample_loss, dtype=torch.int64) if tokens is None else tokens.reshape(-1)
        return self.weigh_sums(per_sample_loss.reshape(-1) * counts, counts, tasks)

    def weigh_sums(self, sums: torch.Tensor, counts: torch.Tensor,
                   tasks: Sequence[str]) -> tuple[torch.Tensor, dict[str, float]]:
        """Like :meth:`weigh` from each sample's summed token loss and its token count."""
        used = self.weights()
        grouped = group_by_task(sums, counts, tasks)
        loss = self.rule.loss(grouped)
        self.rule.update(grouped, self.tasks, self.group)
        return loss, used

    def weigh_tokens(self, token_losses: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor | None,
                     tasks: Sequence[str]) -> tuple[torch.Tensor, dict[str, float]]:
        """Each token's loss times its sample's task weight (same shape as ``token_losses``),
        for a loop that reduces the tokens itself (Megatron's per-token loss); the
        statistics are folded in as in :meth:`weigh`."""
        used = self.weights()
        sums, counts, owner = per_sample_sums(token_losses, labels, cu_seqlens, len(tasks))
        per_sample = torch.tensor([used[t] for t in tasks], dtype=token_losses.dtype, device=token_losses.device)
        self.rule.update(group_by_task(sums.detach(), counts, tasks), self.tasks, self.group)
        return token_losses * per_sample[owner].reshape(token_losses.shape), used

    def describe(self) -> str:
        return ", ".join(f"{task}: w {w:.4f}" + (f" (avg loss {self.rule.averages[task]:.4f})"
                                                 if task in self.rule.averages else " (not seen yet)")
                         for task, w in self.weights().items())

    def state_dict(self) -> dict[str, Any]:
        return {"tasks": list(self.tasks), **self.rule.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state["tasks"]) != list(self.tasks):
            raise ValueError(f"loss weighting state is for tasks {list(state['tasks'])}, this run has {list(self.tasks)}")
        self.rule.load_state_dict(state)
