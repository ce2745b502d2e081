"""Gantt chart of a simulated step: one row per rank, one bar per compute or collective.

Colour says the region, shade says the pass (forward light, backward dark, input-gradient
backward hatched, weight-gradient backward dotted), the number in a bar is its microbatch;
collectives are grey.  :func:`chart` draws any such bars (the main job's report draws its
measured timelines with it too).
matplotlib is imported here only, so the rest of the package runs without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from .actions import COLLECTIVES, Action, Kind
from .simulate import SimResult

_ALPHA = {Kind.FORWARD: 0.45, Kind.BACKWARD: 0.95, Kind.BACKWARD_INPUT: 0.75, Kind.BACKWARD_WEIGHT: 0.95}
_HATCH = {Kind.BACKWARD_INPUT: "//", Kind.BACKWARD_WEIGHT: ".."}
_LABEL = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.BACKWARD_INPUT: "I (input grads)",
          Kind.BACKWARD_WEIGHT: "W (weight grads)"}
GREY = "0.6"


def region_colours(names: Sequence[str]) -> dict[str, str]:
    """One colour per region, in order (matplotlib's default ``tab10`` cycle)."""
    return {name: f"C{i % 10}" for i, name in enumerate(names)}


@dataclass(frozen=True)
class Bar:
    """One bar of a chart: on ``row`` from ``start`` to ``end`` seconds, ``text`` written inside.

    ``height`` and ``offset`` (from the row's centre, downwards) let thin bars (transfers)
    sit under the compute bars of the same row instead of hiding them; ``outline`` draws a
    thin black edge (off for the plain grey collectives).
    """

    row: int
    start: float
    end: float
    colour: Any
    alpha: float = 1.0
    hatch: str | None = None
    text: str = ""
    height: float = 0.8
    offset: float = 0.0
    outline: bool = True


@dataclass(frozen=True)
class Key:
    """One legend entry."""

    label: str
    colour: Any
    alpha: float = 1.0
    hatch: str | None = None


def chart(bars: Sequence[Bar], rows: Sequence[str], keys: Sequence[Key], path: Path, *, title: str,
          span: float) -> list[Any]:
    """Write a chart of ``bars`` over ``rows`` (labels, top to bottom) to ``path`` (PNG, headless).

    ``span`` is the time the x axis covers.  Returns the drawn bar rectangles, one per bar in
    order, so callers can check what was drawn.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(14, 0.55 * len(rows) + 1.8))
    min_label = span / 90
    drawn = []
    for bar in bars:
        drawn.extend(ax.barh(
            bar.row + bar.offset, bar.end - bar.start, left=bar.start, height=bar.height, color=bar.colour,
            alpha=bar.alpha, edgecolor="black" if bar.outline else None,
            linewidth=0.3 if bar.outline else 0, hatch=bar.hatch,
        ))
        if bar.text and bar.end - bar.start >= min_label:
            ax.text((bar.start + bar.end) / 2, bar.row + bar.offset, bar.text, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=8)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, span * 1.01)
    ax.set_xlabel("seconds")
    ax.set_title(title, fontsize=10)
    legend = [Patch(facecolor=k.colour, alpha=k.alpha, hatch=k.hatch, label=k.label) for k in keys]
    if legend:
        ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(rows) < 5 else -0.12),
                  ncol=min(len(legend), 7), fontsize=7, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def draw(result: SimResult, path: str | Path, title: str | None = None,
         text: Callable[[Action], str] | None = None) -> Path:
    """Write the chart of ``result`` (one row per rank) to ``path`` (PNG, headless backend);
    returns ``path``.  ``text``: what a compute's bar says (default: its microbatch; a
    several-step flow plan's :meth:`mindspeed_flow.flow.StepNumbering.label` says its step)."""
    path = Path(path)
    ranks = sorted(result.busy)
    names = [r.name for r in result.plan.regions]
    colour = region_colours(names)
    bars = []
    for iv in result.intervals:
        a = iv.action
        row = ranks.index(iv.rank)
        if a.kind in COLLECTIVES:
            bars.append(Bar(row, iv.start, iv.end, GREY, outline=False))
        else:
            bars.append(Bar(row, iv.start, iv.end, colour[a.region], _ALPHA[a.kind], _HATCH.get(a.kind),
                            text(a) if text else str(a.microbatch)))
    heading = f"step {result.step_time:.2f} s, bubble {result.bubble_fraction:.0%}"
    drawn = {(iv.action.region, iv.action.kind) for iv in result.intervals}
    keys = [Key(f"{n} {_LABEL[k]}", colour[n], _ALPHA[k], _HATCH.get(k)) for n in names for k in _LABEL
            if (n, k) in drawn]
    if any(kind in COLLECTIVES for _, kind in drawn):
        keys.append(Key("collective", GREY))
    chart(bars, [f"r{r} {result.plan.roles.get(r, '')}" for r in ranks], keys, path,
          title=f"{title}: {heading}" if title else heading, span=result.step_time)
    return path
