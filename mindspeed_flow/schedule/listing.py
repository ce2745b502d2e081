"""Plans as text: write one, edit it by hand, read it back, and see it as a grid.

:func:`dumps` writes a header (microbatches, semantics, one line per region with its
skeleton) and then :meth:`.Plan.format`'s listing, one line per action.  :func:`loads`
reads that text back: it rebuilds the regions, derives the placement (paths, roles) from
them and parses every action with :meth:`.Action.from_str`, so the result can go straight
to :func:`.validate` and :func:`.simulate`.  Action numbers (``#3``) and role comments are
written for the reader and ignored on reading, so lines may be moved, added or deleted
freely; every fault is reported with the file and line.

:func:`format_grid` shows a plan as steps (rows) by ranks (columns), like
``torch.distributed.pipelining``'s ``_format_pipeline_order``: each compute in the step it
starts when every compute takes one step and transfers take none, empty cells are bubbles.
Given a second plan, cells that differ read ``before>after``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .actions import COMPUTE, Action
from .errors import ScheduleError
from .placement import Placement, Visit
from .plan import Plan
from .regions import Region
from .simulate import simulate
from .skeletons import Decoupled, GPipe, Interleaved1F1B, OneFOneB, Transpose
from .zero_bubble import ZeroBubbleH1, ZeroBubbleV

SKELETONS = {cls.__name__: cls for cls in (OneFOneB, GPipe, Interleaved1F1B, Transpose, Decoupled,
                                           ZeroBubbleH1, ZeroBubbleV)}
_MAGIC = "# mindspeed-flow plan"
_ACTION_LINE = re.compile(r"^r(?P<rank>\d+)\s+(?:#\d+\s+)?(?P<action>\S.*)$")
_REGION_LINE = re.compile(
    r"^(?P<name>\S+)\s+(?P<layers>\d+)\s+(?P<skeleton>\w+\(.*\))\s+trainable=(?P<trainable>True|False)"
    r"(?:\s+start=(?P<start>\d+))?$"
)


def dumps(plan: Plan) -> str:
    """The plan as text that :func:`loads` reads back to an equal plan."""
    header = [_MAGIC, f"# microbatches {plan.num_microbatches}", f"# semantics {plan.semantics}"]
    for r in plan.regions:
        start = "" if r.start is None else f" start={r.start}"
        header.append(f"# region {r.name} {r.num_layers} {r.skeleton!r} trainable={r.trainable}{start}")
    return "\n".join(header) + "\n" + plan.format() + "\n"


def loads(text: str, source: str = "<text>") -> Plan:
    """Read :func:`dumps`' text (``source`` names it in errors) into a plan."""
    microbatches: int | None = None
    semantics = "eager"
    regions: list[Region] = []
    programs: dict[int, list[Action]] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        where = f"{source}:{number}"
        if not line or line == _MAGIC or line.startswith("# rank "):
            continue
        if line.startswith("# microbatches "):
            microbatches = _integer(line.split()[-1], where)
        elif line.startswith("# semantics "):
            semantics = line.split()[-1]
        elif line.startswith("# region "):
            regions.append(_region(line[len("# region "):], where))
        elif line.startswith("#"):
            continue
        else:
            match = _ACTION_LINE.match(line)
            if not match:
                raise ScheduleError(f"{where}: expected `r<rank> [#<n>] <action>`, got {line!r}")
            try:
                action = Action.from_str(match["action"])
            except ScheduleError as error:
                raise ScheduleError(f"{where}: {error}") from None
            programs.setdefault(int(match["rank"]), []).append(action)
    if microbatches is None:
        raise ScheduleError(f"{source}: no `# microbatches N` line")
    if not regions:
        raise ScheduleError(f"{source}: no `# region ...` line")
    placement = Placement(regions)
    for rank in programs:
        if rank >= placement.num_ranks:
            raise ScheduleError(f"{source}: rank {rank} has a program but the regions place {placement.num_ranks} ranks")
    return Plan(
        regions=tuple(regions),
        num_microbatches=microbatches,
        programs={rank: tuple(programs.get(rank, ())) for rank in range(placement.num_ranks)},
        paths=tuple(placement.path(m) for m in range(microbatches)),
        roles=placement.roles(),
        semantics=semantics,
    )


def _integer(text: str, where: str) -> int:
    if not text.isdigit():
        raise ScheduleError(f"{where}: {text!r} is not a count")
    return int(text)


def _region(text: str, where: str) -> Region:
    match = _REGION_LINE.match(text)
    if not match:
        raise ScheduleError(
            f"{where}: expected `# region NAME LAYERS Skeleton(...) trainable=True|False [start=N]`, got {text!r}"
        )
    return Region(
        match["name"],
        int(match["layers"]),
        _skeleton(match["skeleton"], where),
        trainable=match["trainable"] == "True",
        start=None if match["start"] is None else int(match["start"]),
    )


def _skeleton(text: str, where: str):
    """``OneFOneB(stages=4, layers=None)``: a known skeleton class with literal arguments."""
    try:
        call = ast.parse(text, mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and not call.args):
            raise ValueError
        kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    except (SyntaxError, ValueError):
        raise ScheduleError(f"{where}: {text!r} is not `Skeleton(name=literal, ...)`") from None
    cls = SKELETONS.get(call.func.id)
    if cls is None:
        raise ScheduleError(f"{where}: unknown skeleton {call.func.id!r}, expected one of {sorted(SKELETONS)}")
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise ScheduleError(f"{where}: {text}: {error}") from None


class _OneStepEach:
    """A cost table for :func:`.simulate` in which every compute takes one step and nothing
    else takes time: the grid's clock."""

    def compute_seconds(self, action: Action, visit: Visit) -> float:
        return 1.0

    def transfer_seconds(self, action: Action) -> float:
        return 0.0

    def post_seconds(self, action: Action) -> float:
        return 0.0

    def stored_bytes(self, visit: Visit) -> float:
        return 0.0


def format_grid(plan: Plan, against: Plan | None = None) -> str:
    """Steps by ranks: each compute (``F3 llm.s1``) in the step it starts at one step per
    compute; with ``against``, differing cells read ``against's>plan's``."""
    cells = _cells(plan)
    if against is not None:
        before = _cells(against)
        for step in set(cells) | set(before):
            for rank in set(cells.get(step, {})) | set(before.get(step, {})):
                old, new = before.get(step, {}).get(rank, ""), cells.get(step, {}).get(rank, "")
                if old != new:
                    cells.setdefault(step, {})[rank] = f"{old or '-'}>{new or '-'}"
    ranks = sorted(set(plan.programs) | (set(against.programs) if against else set()))
    steps = max(cells, default=-1) + 1
    labels = [f"Step {s:0{len(str(max(steps - 1, 0)))}d}" for s in range(steps)]
    columns = [[f"Rank {r}"] + [cells.get(s, {}).get(r, "") for s in range(steps)] for r in ranks]
    widths = [max(len(c) for c in column) for column in columns]
    pad = max((len(label) for label in labels), default=4)
    lines = [" " * pad + "  " + " ".join(c[0].ljust(w) for c, w in zip(columns, widths)).rstrip()]
    for s, label in enumerate(labels):
        row = " ".join(c[s + 1].ljust(w) for c, w in zip(columns, widths))
        lines.append(f"{label.ljust(pad)}: {row}".rstrip())
    return "\n".join(lines)


def _cells(plan: Plan) -> dict[int, dict[int, str]]:
    result = simulate(plan, _OneStepEach())  # type: ignore[arg-type]  # duck-typed clock
    cells: dict[int, dict[int, str]] = {}
    for iv in result.intervals:
        a = iv.action
        if a.kind in COMPUTE:
            cells.setdefault(int(round(iv.start)), {})[iv.rank] = f"{a.kind.value}{a.microbatch} {a.region}.s{a.stage}"
    return cells


def dump(plan: Plan, path: str | Path) -> Path:
    """Write :func:`dumps` to ``path``."""
    path = Path(path)
    path.write_text(dumps(plan))
    return path


def load(path: str | Path) -> Plan:
    """Read a plan written by :func:`dump` (or edited by hand)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise ScheduleError(f"{path}: cannot read ({error.strerror})") from None
    return loads(text, str(path))


