"""Gantt chart of a simulated step: one row per rank, one bar per compute or collective.

Colour says the region, shade says the pass (forward light, backward dark, input-gradient
backward hatched, weight-gradient backward dotted), the number in a bar is its microbatch;
collectives are grey.
matplotlib is imported here only, so the rest of the package runs without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from .actions import COLLECTIVES, Kind

if TYPE_CHECKING:
    from .simulate import SimResult

_ALPHA = {Kind.FORWARD: 0.45, Kind.BACKWARD: 0.95, Kind.BACKWARD_INPUT: 0.75, Kind.BACKWARD_WEIGHT: 0.95}
_HATCH = {Kind.BACKWARD_INPUT: "//", Kind.BACKWARD_WEIGHT: ".."}
_LABEL = {Kind.FORWARD: "F", Kind.BACKWARD: "B", Kind.BACKWARD_INPUT: "I (input grads)",
          Kind.BACKWARD_WEIGHT: "W (weight grads)"}


def draw(result: SimResult, path: Path, title: str | None = None) -> Path:
    """Write the chart of ``result`` to ``path`` (PNG, headless backend); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted(result.busy)
    names = [r.name for r in result.plan.regions]
    palette = plt.get_cmap("tab10")
    colour = {name: palette(i % 10) for i, name in enumerate(names)}
    fig, ax = plt.subplots(figsize=(14, 0.55 * len(ranks) + 1.8))
    min_label = result.step_time / 90
    for iv in result.intervals:
        y = ranks.index(iv.rank)
        a = iv.action
        if a.kind in COLLECTIVES:
            ax.barh(y, iv.end - iv.start, left=iv.start, height=0.8, color="0.6")
            continue
        ax.barh(
            y, iv.end - iv.start, left=iv.start, height=0.8, color=colour[a.region],
            alpha=_ALPHA[a.kind], edgecolor="black", linewidth=0.3, hatch=_HATCH.get(a.kind),
        )
        if iv.end - iv.start >= min_label:
            ax.text((iv.start + iv.end) / 2, y, str(a.microbatch), ha="center", va="center", fontsize=6)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"r{r} {result.plan.roles.get(r, '')}" for r in ranks], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, result.step_time * 1.01)
    ax.set_xlabel("seconds")
    heading = f"step {result.step_time:.2f} s, bubble {result.bubble_fraction:.0%}"
    ax.set_title(f"{title}: {heading}" if title else heading, fontsize=10)
    drawn = {(iv.action.region, iv.action.kind) for iv in result.intervals}
    legend = [Patch(facecolor=colour[n], alpha=_ALPHA[k], hatch=_HATCH.get(k), label=f"{n} {_LABEL[k]}")
              for n in names for k in _LABEL
              if (n, k) in drawn]
    if any(kind in COLLECTIVES for _, kind in drawn):
        legend.append(Patch(color="0.6", label="collective"))
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(ranks) < 5 else -0.12),
              ncol=min(len(legend), 7), fontsize=7, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
