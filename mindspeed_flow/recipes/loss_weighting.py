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
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

IGNORE = -100


def task_by_file(patterns: Mapping[str, str], default: str = "default") -> Callable[[str], str]:
    """``task_of`` from ``{glob on the source file name: task}``, first match wins."""
    def task_of(sample_id: str) -> str:
        file = sample_id.rsplit(":", 1)[0]
        return next((task for pattern, task in patterns.items() if fnmatch.fnmatch(file, pattern)), default)
    return task_of


def per_task_sums(token_losses: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor,
                  sample_ids: Sequence[str], task_of: Callable[[str], str]) -> dict[str, tuple[torch.Tensor, int]]:
    """``{task: (summed token loss, counted tokens)}`` of one packed microbatch.

    ``token_losses`` and ``labels`` are ``[1, T]`` (or ``[T]``); tokens whose label is -100
    are not counted.
    """
    losses, mask = token_losses.reshape(-1), labels.reshape(-1) != IGNORE
    bounds = cu_seqlens.tolist()
    if len(bounds) != len(sample_ids) + 1:
        raise ValueError(f"cu_seqlens has {len(bounds) - 1} segments but the batch has {len(sample_ids)} sample_ids")
    sums: dict[str, tuple[torch.Tensor, int]] = {}
    for sid, lo, hi in zip(sample_ids, bounds[:-1], bounds[1:]):
        task = task_of(sid)
        total, count = sums.get(task, (losses.new_zeros(()), 0))
        sums[task] = (total + losses[lo:hi][mask[lo:hi]].sum(), count + int(mask[lo:hi].sum()))
    return sums


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
