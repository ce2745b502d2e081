"""The main job's report: a terminal table and a ``report/`` folder built from the runs' records.

``format_table`` is what the job prints at the end: one line per run with its rates, its
ratio to every baseline run, what its step of the ablation chain bought (its samples/s over
the run before it in the chain) and its fraction of the text-only upper bound, the chain's
verdict (which feature the largest gain came from), then one line per rank.
``write_report`` writes

* ``metrics.json``: every record (steps, intervals, ranks) and every derived number, so the
  report can be rebuilt and checked without rerunning (:func:`read_records`);
* ``summary.md``: the table, the parity and resume verdicts, each run's layout / plan text;
* ``loss_curves.png``: the runs' losses per step and over training time (and the parity /
  resume curves when given);
* ``gantt_<run>.png``: the measured timeline of one step, one row per rank (drawn with the
  schedule simulator's chart, :func:`mindspeed_flow.schedule.gantt.chart`);
* ``memory.png``: peak memory per rank of each run.

matplotlib is imported inside the drawing functions only.
"""

from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path
from typing import Any, Sequence

from mindspeed_flow.train.metrics import (
    COMPUTE_KINDS,
    KINDS,
    NO_MICROBATCH,
    REGIONS,
    ParityResult,
    ResumeResult,
    RunRecord,
    throughput_ratio,
)
from mindspeed_flow.train.runs import FLOWTRAIN, TEXT_ONLY, is_baseline

BASELINE = "baseline"
RULES = ("rates over the measured steps (every step but the first, warm-up one); tokens are real "
         "(non-padding) tokens; x <baseline run> = samples/s over that baseline run's (baseline: the "
         "MindSpeed-MM-style layout; baseline-ppN[-mbsM]: the same baseline at PP=N (M samples per "
         "microbatch), its best configuration; "
         "baseline-thd: packed Megatron, THD attention without a dense mask, Conv->Matmul, ViT in stage 0, 1F1B; "
         "three-phase: ViT forward over the step, LLM 1F1B on detached embeddings, ViT backward); "
         "bought = samples/s over the run before it in the ablation chain (baseline -> packing -> varlen -> "
         "conv-matmul -> flowtrain, one feature more each); of text-only = samples/s over the text-only run's "
         "(the same backbone on the same token sequences without the ViT: the upper bound); "
         "padding = 1 - real / computed tokens; idle = 1 - compute (F/B/W) time / step time per rank")
# How a measured interval is drawn: compute bars fill the row (forward light, backward dark,
# weight-gradient backward dotted); transfers are thin hatched bars under them.
_ALPHA = {"F": 0.45, "B": 0.95, "W": 0.95, "PUT": 0.5, "GET": 0.5, "SEND": 0.5, "RECV": 0.5, "REDUCE": 0.5}
_HATCH = {"W": "..", "PUT": "//", "GET": "\\\\", "SEND": "--", "RECV": "||", "REDUCE": "xx"}
_AHEAD_HATCH = "oo"  # compute on a later step's data (the flow's producer running ahead)
_LABEL = {"F": "F", "B": "B", "W": "W (weight grads)", "PUT": "pool put", "GET": "pool get", "SEND": "send",
          "RECV": "recv", "REDUCE": "grad reduce"}


def _baseline(records: Sequence[RunRecord]) -> RunRecord | None:
    return next((r for r in records if r.name == BASELINE), None)


def _baselines(records: Sequence[RunRecord]) -> list[RunRecord]:
    """Every baseline run, the MindSpeed-MM-style ``baseline`` first, then the others in run
    order (``baseline-pp<N>``: the same baseline in another layout; ``baseline-thd``: packed
    THD Megatron; ``three-phase``: the --hetero-parallel / MIMO schedule)."""
    others = [r for r in records if is_baseline(r.name) and r.name != BASELINE]
    main = _baseline(records)
    return ([main] if main is not None else []) + others


def _text_only(records: Sequence[RunRecord]) -> RunRecord | None:
    return next((r for r in records if r.name == TEXT_ONLY), None)


def bought(records: Sequence[RunRecord]) -> dict[str, dict[str, float]]:
    """What each step of the ablation chain bought: for every run whose previous run in the
    chain is among ``records``, its samples/s and tokens/s over that run's."""
    by_name = {r.name: r for r in records}
    return {r.name: throughput_ratio(r, by_name[r.ablation_previous]) for r in records
            if r.ablation_previous in by_name}


def largest_gain(records: Sequence[RunRecord]) -> RunRecord | None:
    """The chain's run whose step bought the most samples/s (``None``: no step measured)."""
    gains = {name: ratio["samples_per_s"] for name, ratio in bought(records).items()
             if math.isfinite(ratio["samples_per_s"])}
    if not gains:
        return None
    return next(r for r in records if r.name == max(gains, key=gains.__getitem__))


def _ablation_lines(records: Sequence[RunRecord]) -> list[str]:
    """The chain's steps with what each bought, and which feature the largest gain came from."""
    gains = bought(records)
    best = largest_gain(records)
    if best is None:
        return []
    steps = ", ".join(f"{r.name} {gains[r.name]['samples_per_s']:.2f}x" for r in records if r.name in gains)
    return [f"ablation (each run's samples/s over the run before it, one feature more): {steps}",
            f"the largest gain came from {best.ablation_adds}: {best.name} is "
            f"{gains[best.name]['samples_per_s']:.2f}x {best.ablation_previous}"]


def _text_only_lines(records: Sequence[RunRecord]) -> list[str]:
    text, flow = _text_only(records), next((r for r in records if r.name == FLOWTRAIN), None)
    if text is None or flow is None:
        return []
    fraction = throughput_ratio(flow, text)["samples_per_s"]
    return [f"{flow.name} reaches {fraction:.0%} of the text-only throughput ({flow.samples_per_s():.2f} vs "
            f"{text.samples_per_s():.2f} samples/s on the same token sequences; text-only: {text.layout})"]


def _grid(header: Sequence[str], rows: Sequence[Sequence[str]], text_columns: int) -> list[str]:
    """Columns padded to their widest cell: the first ``text_columns`` left-aligned, numbers right."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i < text_columns else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    return [line(header), "-" * len(line(header)), *map(line, rows)]


def _ratio_text(record: RunRecord, baseline: RunRecord | None) -> str:
    if baseline is None:
        return "-"
    ratio = throughput_ratio(record, baseline)["samples_per_s"]
    return "-" if math.isnan(ratio) else f"{ratio:.2f}x"


def _devices(record: RunRecord) -> str:
    return f"{record.world_size} {record.device}".rstrip()


def _against_baselines(records: Sequence[RunRecord], baselines: Sequence[RunRecord]) -> list[str]:
    """One line per run that is not a baseline, when there are several baselines: its
    samples/s ratio against each, named by layout."""
    if len(baselines) < 2:
        return []
    return [f"{r.name}: " + "; ".join(f"{_ratio_text(r, b)} {b.name} ({b.layout})" for b in baselines)
            for r in records if r not in baselines]


def format_table(records: Sequence[RunRecord]) -> str:
    """The terminal table: one line per run (with its samples/s ratio against every baseline
    run), then one line per rank of each run."""
    baselines = _baselines(records)
    columns: list[RunRecord | None] = list(baselines) or [None]  # no baseline run: one column of "-"
    gains, text = bought(records), _text_only(records)
    extra = (["bought"] if gains else []) + (["of text-only"] if text is not None else [])

    def extras(r: RunRecord) -> list[str]:
        cells = []
        if gains:
            ratio = gains.get(r.name, {}).get("samples_per_s", math.nan)
            cells.append("-" if math.isnan(ratio) else f"{ratio:.2f}x")
        if text is not None:
            ratio = throughput_ratio(r, text)["samples_per_s"]
            cells.append("-" if math.isnan(ratio) else f"{ratio:.0%}")
        return cells

    runs = [[r.name, _devices(r), r.layout, f"{r.samples_per_s():.2f}", f"{r.tokens_per_s():.0f}",
             *(_ratio_text(r, b) for b in columns), *extras(r), f"{r.padding_fraction():.1%}",
             f"{r.peak_memory_mb():.0f}"]
            for r in records]
    ranks = [[f"{r.name} r{k.rank}", k.role, f"{k.idle_fraction:.1%}", f"{k.busy_s:.3f}", f"{k.step_s:.3f}",
              f"{k.peak_memory_mb:.0f}"]
             for r in records for k in sorted(r.ranks, key=lambda k: k.rank)]
    ratios = [f"x {b.name if b else BASELINE}" for b in columns]
    lines = _grid(["run", "devices", "layout", "samples/s", "tokens/s", *ratios, *extra, "padding", "peak MB"],
                  runs, 3)
    lines += _against_baselines(records, baselines) + _ablation_lines(records) + _text_only_lines(records)
    lines += [""] + _grid(["rank", "role", "idle", "busy s", "step s", "peak MB"], ranks, 2)
    lines += [""] + textwrap.wrap(RULES, 100)
    return "\n".join(lines)


def _finite(x: float) -> float | None:
    """JSON has no NaN: an undefined ratio is written as null."""
    return x if math.isfinite(x) else None


def metrics_json(records: Sequence[RunRecord], *, parity: ParityResult | None = None,
                 resume: ResumeResult | None = None) -> dict[str, Any]:
    """Everything measured and derived, as written to ``metrics.json``."""
    base = _baseline(records)
    baselines = _baselines(records)
    gains, text = bought(records), _text_only(records)
    runs = {}
    for r in records:
        entry: dict[str, Any] = {"derived": r.derived(), "record": r.to_json()}
        if base is not None:
            entry["ratio_to_baseline"] = {k: _finite(v) for k, v in throughput_ratio(r, base).items()}
        if baselines:  # every baseline run by name (the MindSpeed-MM-style one and its best configuration)
            entry["ratio_to"] = {b.name: {k: _finite(v) for k, v in throughput_ratio(r, b).items()}
                                 for b in baselines}
        if r.name in gains:  # its step of the ablation chain
            entry["bought"] = {"previous": r.ablation_previous, "adds": r.ablation_adds,
                               **{k: _finite(v) for k, v in gains[r.name].items()}}
        if text is not None:
            entry["fraction_of_text_only"] = {k: _finite(v) for k, v in throughput_ratio(r, text).items()}
        runs[r.name] = entry
    best = largest_gain(records)
    largest = None if best is None else {"run": best.name, "adds": best.ablation_adds,
                                         "samples_per_s": _finite(gains[best.name]["samples_per_s"])}
    return {"rules": RULES, "runs": runs, "largest_gain": largest,
            "parity": parity.to_json() if parity else None, "resume": resume.to_json() if resume else None}


def read_records(path: Path) -> list[RunRecord]:
    """The run records of a ``metrics.json`` written by :func:`write_report`."""
    data = json.loads(Path(path).read_text())
    return [RunRecord.from_json(entry["record"]) for entry in data["runs"].values()]


def _summary(records: Sequence[RunRecord], parity: ParityResult | None, resume: ResumeResult | None,
             charts: Sequence[str]) -> str:
    out = ["# Training report", ""]
    if records:
        out += ["```", format_table(records), "```", ""]
    out += ["## Checks", ""]
    out.append(f"- {parity.verdict()}" if parity else "- parity: not run")
    out.append(f"- {resume.verdict()}" if resume else "- resume: not run")
    for r in records:
        out += ["", f"## {r.name}", "", f"- layout: {r.layout}", f"- devices: {_devices(r)}",
                f"- features: {', '.join(r.features) if r.features else 'none'}",
                f"- steps: {len(r.steps)}, final loss {r.steps[-1].loss:.4f}" if r.steps else "- steps: none"]
        if r.plan_text:
            out += ["", "```", r.plan_text.rstrip(), "```"]
    out += ["", "## Charts", ""] + [f"![{Path(c).stem}]({c})" for c in charts]
    return "\n".join(out) + "\n"


def _timeline_end(record: RunRecord) -> float:
    return max((iv.end for iv in record.timeline), default=0.0)


def timeline_gantt(record: RunRecord, path: Path, *, span: float | None = None) -> list[Any]:
    """Draw ``record.timeline`` (one measured step, one row per rank) to ``path``.

    ``span``: the seconds the time axis covers (default: to the last interval's end); the
    report gives every run the same, so the charts compare at a glance.
    Returns the drawn bar rectangles, one per interval in timeline order.
    """
    from mindspeed_flow.schedule.gantt import Bar, Key, chart, region_colours

    colour = region_colours(REGIONS)
    roles = {k.rank: k.role for k in record.ranks}
    bars = []
    for iv in record.timeline:
        text = "" if iv.microbatch == NO_MICROBATCH else str(iv.microbatch)
        if iv.ahead:
            text = f"s+{iv.ahead}:{text}"
        shape = {} if iv.kind in COMPUTE_KINDS else {"height": 0.25, "offset": 0.3}
        hatch = _AHEAD_HATCH if iv.ahead and iv.kind in COMPUTE_KINDS else _HATCH.get(iv.kind)
        bars.append(Bar(iv.rank, iv.start, iv.end, colour[iv.region], _ALPHA[iv.kind], hatch,
                        text if iv.kind in COMPUTE_KINDS else "", **shape))
    drawn = {(iv.region, iv.kind) for iv in record.timeline if not (iv.ahead and iv.kind in COMPUTE_KINDS)}
    keys = [Key(f"{region} {_LABEL[kind]}", colour[region], _ALPHA[kind], _HATCH.get(kind))
            for region in REGIONS for kind in KINDS if (region, kind) in drawn]
    keys += [Key(f"{region} {_LABEL[kind]}, next step's data (running ahead)", colour[region], _ALPHA[kind],
                 _AHEAD_HATCH) for region, kind in sorted({(iv.region, iv.kind) for iv in record.timeline
                                                           if iv.ahead and iv.kind in COMPUTE_KINDS})]
    end = _timeline_end(record)
    span = span or end or 1.0
    idle = sum(k.idle_fraction for k in record.ranks) / len(record.ranks) if record.ranks else math.nan
    title = (f"{record.name} ({record.layout}): one measured step {end:.3f} s; "
             f"mean idle over measured steps {idle:.0%}")
    rows = [f"r{rank} {roles.get(rank, '')}".rstrip() for rank in range(record.world_size)]
    return chart(bars, rows, keys, path, title=title, span=span)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


_MARKERS = ("o", "s", "^", "v", "D", "x", "*", "P")


def _style(index: int) -> dict:
    """Each run its own marker, solid and dashed lines alternating: equal curves (same
    samples, same init) stay visible on top of each other."""
    return {"marker": _MARKERS[index % len(_MARKERS)], "markersize": 4, "linestyle": ("-", "--")[index % 2]}


def loss_curves(records: Sequence[RunRecord], path: Path, *, parity: ParityResult | None = None,
                resume: ResumeResult | None = None) -> Path | None:
    """The runs' losses per step and over training time (the per-step curves of runs that
    train the same model on the same samples are one line; over time they show which run
    gets there first), and a panel each for the parity and resume comparisons when given;
    nothing is written (``None``) when there is nothing to draw."""
    solid, dashed = {"marker": "o"}, {"marker": ".", "linestyle": "--"}
    # (title, x label, curves as (label, x, losses, style), step after which a line is drawn)
    panels: list[tuple[str, str, list[tuple[str, Sequence[float], list[float], dict]], int | None]] = []
    if records:
        panels.append(("step loss", "step", [(r.name, [s.step for s in r.steps], r.losses(), _style(i))
                                             for i, r in enumerate(records)], None))
        panels.append(("loss over training time (summed step times)", "seconds",
                       [(r.name, r.elapsed(), r.losses(), _style(i)) for i, r in enumerate(records)], None))
    if parity is not None:
        panels.append((f"parity {'PASS' if parity.passed else 'FAIL'}: max rel dev {parity.max_rel_deviation:.1e}",
                       "step", [("baseline (same packs)", parity.steps, parity.baseline, solid),
                                ("flowtrain (same packs)", parity.steps, parity.flowtrain, dashed)], None))
    if resume is not None:
        panels.append((f"resume {'PASS' if resume.passed else 'FAIL'} ({resume.run}): "
                       f"max dev {resume.max_abs_deviation:.1e}", "step",
                       [("uninterrupted", resume.steps, resume.uninterrupted, solid),
                        ("stopped + resumed", resume.steps, resume.resumed, dashed)], resume.stop_step))
    if not panels:
        return None
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, (title, xlabel, curves, stop) in zip(axes[0], panels):
        for label, xs, losses, style in curves:
            ax.plot(xs, losses, label=label, **style)
        if stop is not None:
            ax.axvline(stop + 0.5, color="0.5", linewidth=0.8)
        ax.set_title(title, fontsize=10)
        if xlabel == "step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def memory_chart(records: Sequence[RunRecord], path: Path) -> Path:
    """Peak memory per rank, one group of bars per rank, one bar per run."""
    plt = _pyplot()
    world = max((r.world_size for r in records), default=1)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * world + 2), 3.5))
    width = 0.8 / max(len(records), 1)
    for i, r in enumerate(records):
        ranks = sorted(r.ranks, key=lambda k: k.rank)
        ax.bar([k.rank + (i - (len(records) - 1) / 2) * width for k in ranks], [k.peak_memory_mb for k in ranks],
               width=width, label=r.name)
    ax.set_xticks(range(world))
    ax.set_xticklabels([f"r{k}" for k in range(world)])
    ax.set_ylabel("peak memory (MB)")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def write_report(records: Sequence[RunRecord], out: Path, *, parity: ParityResult | None = None,
                 resume: ResumeResult | None = None) -> Path:
    """Write the report folder ``out`` (created if needed) and return it.

    The charts of what ran: no Gantt or memory chart without run records (a parity-only
    job), no loss curves without records, parity or resume.
    """
    names = [r.name for r in records]
    if len(set(names)) != len(names) or not all(re.fullmatch(r"[\w.-]+", n) for n in names):
        raise ValueError(f"write_report: run names name the Gantt files, so they must be distinct words "
                         f"(letters, digits, _ . -), got {names}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps(metrics_json(records, parity=parity, resume=resume), indent=1))
    curves = loss_curves(records, out / "loss_curves.png", parity=parity, resume=resume)
    charts = [curves.name] if curves else []
    span = max(map(_timeline_end, records), default=0.0)
    for r in records:
        timeline_gantt(r, out / f"gantt_{r.name}.png", span=span)
        charts.append(f"gantt_{r.name}.png")
    if records:
        charts.append(memory_chart(records, out / "memory.png").name)
    (out / "summary.md").write_text(_summary(records, parity, resume, charts))
    return out
