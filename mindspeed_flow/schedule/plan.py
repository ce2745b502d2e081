"""A composed schedule: per-rank programs plus the placement facts needed to check them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
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
    """

    regions: tuple[Region, ...]
    num_microbatches: int
    programs: Mapping[int, tuple[Action, ...]]
    paths: tuple[tuple[Visit, ...], ...]
    roles: Mapping[int, str]
    semantics: str = "eager"

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

    # Text round trip and grid live in .listing, which builds plans and so imports this
    # module: the methods below import it when called.

    def dumps(self) -> str:
        """The plan as text (header with the regions, then :meth:`format`); see :mod:`.listing`."""
        from .listing import dumps

        return dumps(self)

    def dump(self, path: str | Path) -> Path:
        """Write :meth:`dumps` to ``path``, to edit by hand and :meth:`load` again."""
        from .listing import dump

        return dump(self, path)

    @classmethod
    def loads(cls, text: str, source: str = "<text>") -> Plan:
        """Read :meth:`dumps`' text back; errors name ``source`` and the line."""
        from .listing import loads

        return loads(text, source)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a file written by :meth:`dump`, possibly edited by hand."""
        from .listing import load

        return load(path)

    def grid(self, against: Plan | None = None) -> str:
        """Steps by ranks, one step per compute; with ``against``, differing cells read
        ``before>after`` (see :func:`.listing.format_grid`)."""
        from .listing import format_grid

        return format_grid(self, against)
