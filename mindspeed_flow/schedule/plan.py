"""A composed schedule: per-rank programs plus the placement facts needed to check them.

:class:`Plan` is plain data.  What is done with a plan lives beside it as free functions
that import this module, never the other way round: the text round trip and the grid in
:mod:`.listing`, the replay in :mod:`.simulate`, its chart in :mod:`.gantt`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Mapping

from .actions import Action, format_program
from .placement import Visit
from .regions import Region


@dataclass(frozen=True)
class Plan:
    """What :func:`.compose` returns and :func:`.validate` / :func:`.simulate` read.

    Attributes:
        regions: the regions, in model order.
        num_microbatches: microbatches per step.
        programs: rank -> that rank's actions, in execution order.
        paths: per microbatch, its visits in model order (the intended data flow).
        roles: rank -> short label of what it runs.
        semantics: the blocking semantics the programs were made for and are checked and
            replayed under (``"eager"`` or ``"rendezvous"``, see :mod:`.validate`).
        samples: a flow plan's groups (:mod:`mindspeed_flow.flow.plan`): microbatch -> the
            ids of the samples it sends or takes through the pool one by one (its ``smp``
            transfers).  Empty for every other plan.
    """

    regions: tuple[Region, ...]
    num_microbatches: int
    programs: Mapping[int, tuple[Action, ...]]
    paths: tuple[tuple[Visit, ...], ...]
    roles: Mapping[int, str]
    semantics: str = "eager"
    samples: Mapping[int, tuple[int, ...]] = field(default_factory=dict)

    @cached_property
    def visits(self) -> dict[tuple[int, str, int], tuple[int, Visit]]:
        """(microbatch, region, stage) -> (index on the path, visit)."""
        return {
            (m, v.region, v.stage): (k, v)
            for m, path in enumerate(self.paths)
            for k, v in enumerate(path)
        }

    def format(self) -> str:
        """Every program, one line per action, ranks in order."""
        return "\n".join(
            f"# rank {rank}: {self.roles.get(rank, '')}\n{format_program(rank, program)}"
            for rank, program in sorted(self.programs.items())
        )
