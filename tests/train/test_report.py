"""The main job's records and report (train/metrics.py, train/report.py) on hand-made measurements.

Every expected number below is computed by hand in the comments from the synthetic steps, so a
wrong warm-up rule, a padded-token mix-up or an idle fraction over the wrong steps fails.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from mindspeed_flow.train.metrics import (
    Interval,
    MetricsError,
    ParityResult,
    RankRecord,
    ResumeResult,
    RunRecord,
    StepOutcome,
    busy_seconds,
    throughput_ratio,
)
from mindspeed_flow.train.report import (
    bought,
    format_table,
    largest_gain,
    metrics_json,
    read_records,
    timeline_gantt,
    write_report,
)


def _rank_steps(rank: int, step_times: list[float], scale: float) -> list[StepOutcome]:
    """Three steps of counts (4 samples; 300, 300, 340 real tokens of 400 computed) and one rank's intervals.

    Step 1 (warm-up) is busy the whole time, so counting it would change every idle fraction.
    Rank 0, step 2: F 0-0.5, B 0.5-1.5 (busy 1.5), then a SEND 1.5-1.8 (not compute).
    Rank 0, step 3: F 0-1.0 and W 0.8-1.6 overlap: busy is their union, 1.6.
    Rank 1 is busy 1.0 in step 2 (F 0.2-0.6, B 0.6-1.2) and 0.5 in step 3 (REDUCE aside).
    Measured-step times are multiplied by ``scale`` (a faster run).
    """
    first = [Interval(rank, "llm", "F", 0, 0.0, step_times[0])]
    if rank == 0:
        second = [Interval(0, "vit", "F", 0, 0.0, 0.5), Interval(0, "llm", "B", 0, 0.5, 1.5),
                  Interval(0, "llm", "SEND", 0, 1.5, 1.8)]
        third = [Interval(0, "llm", "F", 1, 0.0, 1.0), Interval(0, "llm", "W", 1, 0.8, 1.6)]
    else:
        second = [Interval(1, "llm", "F", 0, 0.2, 0.6), Interval(1, "llm", "B", 0, 0.6, 1.2)]
        third = [Interval(1, "llm", "B", 1, 0.0, 0.5), Interval(1, "llm", "REDUCE", -1, 0.5, 0.9)]
    second, third = ([Interval(iv.rank, iv.region, iv.kind, iv.microbatch, iv.start * scale, iv.end * scale)
                      for iv in ivs] for ivs in (second, third))
    tokens = [300, 300, 340]
    return [StepOutcome(k + 1, 3.0 - k, 4, tokens[k], 400, step_times[k], ivs)
            for k, ivs in enumerate([first, second, third])]


def _run(name: str, step_times: list[float], *, padded: bool) -> RunRecord:
    per_rank = {r: _rank_steps(r, step_times, step_times[1] / 2.0) for r in (0, 1)}
    steps = per_rank[0]
    if not padded:
        steps = [StepOutcome(s.step, s.loss, s.samples, s.tokens, s.tokens, s.step_s, s.intervals) for s in steps]
    ranks = [RankRecord.measure(r, f"llm.s{r}", 100.0 + 50 * r, per_rank[r]) for r in (0, 1)]
    timeline = per_rank[0][1].intervals + per_rank[1][1].intervals
    return RunRecord(name, f"{name} layout", 2, ["feature-a"], f"{name} plan\nline 2", steps, ranks, timeline, "cpu")


@pytest.fixture
def runs() -> list[RunRecord]:
    # baseline: steps of 5 (warm-up), 2 and 2 s; flowtrain: 4 (warm-up), 1 and 1 s, nothing padded.
    return [_run("baseline", [5.0, 2.0, 2.0], padded=True), _run("flowtrain", [4.0, 1.0, 1.0], padded=False)]


def test_rates_exclude_the_warm_up_step_and_count_real_tokens(runs):
    base, flow = runs
    # measured steps 2 and 3: 8 samples, 640 real tokens; baseline 4 s, flowtrain 2 s
    assert base.samples_per_s() == pytest.approx(2.0)
    assert base.tokens_per_s() == pytest.approx(160.0)
    assert flow.samples_per_s() == pytest.approx(4.0)
    assert flow.tokens_per_s() == pytest.approx(320.0)
    assert throughput_ratio(flow, base) == pytest.approx({"samples_per_s": 2.0, "tokens_per_s": 2.0})
    # padding over every step: 1 - 940 / 1200
    assert base.padding_fraction() == pytest.approx(13 / 60)
    assert flow.padding_fraction() == 0.0
    assert base.peak_memory_mb() == 150.0


def test_a_single_step_run_measures_that_step():
    only = StepOutcome(1, 1.0, 6, 120, 150, 3.0)
    run = RunRecord("one", "l", 1, [], None, [only], [], [])
    assert run.samples_per_s() == pytest.approx(2.0)
    assert run.tokens_per_s() == pytest.approx(40.0)


def test_idle_fraction_is_one_minus_compute_over_step_time_of_the_measured_steps(runs):
    base, flow = runs
    r0, r1 = base.ranks
    # rank 0: busy 1.5 + 1.6 of 2 + 2 s -> idle 0.225; rank 1: 1.0 + 0.5 of 4 s -> 0.625
    assert (r0.busy_s, r0.step_s, r0.idle_fraction) == pytest.approx((3.1, 4.0, 0.225))
    assert (r1.busy_s, r1.step_s, r1.idle_fraction) == pytest.approx((1.5, 4.0, 0.625))
    # flowtrain: every measured interval and step twice as fast, so the same fractions
    assert [r.busy_s for r in flow.ranks] == pytest.approx([1.55, 0.75])
    assert [r.idle_fraction for r in flow.ranks] == pytest.approx([0.225, 0.625])
    assert busy_seconds([Interval(0, "llm", "F", 0, 0.0, 1.0), Interval(0, "llm", "B", 0, 0.25, 0.5),
                         Interval(0, "llm", "GET", 0, 0.0, 3.0), Interval(0, "llm", "B", 1, 2.0, 2.5)]) == 1.5


def test_json_round_trip_keeps_every_field(runs):
    for run in runs:
        text = json.dumps(run.to_json())
        assert RunRecord.from_json(json.loads(text)) == run
    parity = ParityResult.compare([1, 2], [2.0, 1.5], [2.0, 1.5])
    resume = ResumeResult.compare("flowtrain", 1, [1, 2], [2.0, 1.5], [2.0, 1.5])
    assert ParityResult.from_json(json.loads(json.dumps(parity.to_json()))) == parity
    assert ResumeResult.from_json(json.loads(json.dumps(resume.to_json()))) == resume


def test_parity_tolerance_is_tighter_on_the_first_step():
    ok = ParityResult.compare([1, 2], [2.0, 1.0], [2.0 * (1 + 5e-6), 1.0 * (1 + 5e-5)])
    assert ok.passed and ok.max_rel_deviation == pytest.approx(5e-5, rel=1e-3)
    first_off = ParityResult.compare([1, 2], [2.0, 1.0], [2.0 * (1 + 5e-5), 1.0])
    assert not first_off.passed and "FAIL" in first_off.verdict()
    with pytest.raises(MetricsError, match="one loss per step"):
        ParityResult.compare([1, 2], [2.0], [2.0, 1.0])


def test_resume_must_continue_exactly_without_repeating_samples():
    steps, losses = [1, 2, 3], [2.0, 1.5, 1.25]
    assert ResumeResult.compare("flowtrain", 2, steps, losses, list(losses)).passed
    drift = ResumeResult.compare("flowtrain", 2, steps, losses, [2.0, 1.5, 1.2500001])
    assert not drift.passed and drift.max_abs_deviation == pytest.approx(1e-7, rel=1e-3)
    repeated = ResumeResult.compare("flowtrain", 2, steps, losses, list(losses), repeated_samples=["s17"])
    assert not repeated.passed and "'s17'" in repeated.verdict()
    with pytest.raises(MetricsError, match="stop_step 3"):
        ResumeResult.compare("flowtrain", 3, steps, losses, losses)


def _row(table: str, first: str) -> list[str]:
    return next(line.split("  ") for line in table.splitlines() if line.startswith(first + " "))


def test_table_shows_rates_ratio_padding_idle_and_memory(runs):
    table = format_table(runs)
    base = [c.strip() for c in _row(table, "baseline") if c.strip()]
    flow = [c.strip() for c in _row(table, "flowtrain") if c.strip()]
    assert base == ["baseline", "2 cpu", "baseline layout", "2.00", "160", "1.00x", "21.7%", "150"]
    assert flow == ["flowtrain", "2 cpu", "flowtrain layout", "4.00", "320", "2.00x", "0.0%", "150"]
    rank1 = [c.strip() for c in _row(table, "baseline r1") if c.strip()]
    assert rank1 == ["baseline r1", "llm.s1", "62.5%", "1.500", "4.000", "150"]
    assert "warm-up" in table


def test_table_and_report_give_the_ratio_against_both_baselines(runs, tmp_path):
    # baseline-pp1 (the baseline's best layout): measured steps of 1.6 s -> 8 samples / 3.2 s = 2.5 samples/s;
    # flowtrain's 4.0 samples/s is 4.0 / 2.0 = 2.00x the MindSpeed-MM-style baseline and 4.0 / 2.5 = 1.60x the best
    base, flow = runs
    best = _run("baseline-pp1", [5.0, 1.6, 1.6], padded=True)
    records = [base, best, flow]
    table = format_table(records)
    header = table.splitlines()[0].split()
    assert header[5:9] == ["x", "baseline", "x", "baseline-pp1"]
    assert [c.strip() for c in _row(table, "flowtrain") if c.strip()][5:7] == ["2.00x", "1.60x"]
    assert [c.strip() for c in _row(table, "baseline-pp1") if c.strip()][3:7] == ["2.50", "200", "1.25x", "1.00x"]
    assert [c.strip() for c in _row(table, "baseline") if c.strip()][5:7] == ["1.00x", "0.80x"]
    assert ("flowtrain: 2.00x baseline (baseline layout); 1.60x baseline-pp1 (baseline-pp1 layout)"
            in table.splitlines())
    out = write_report(records, tmp_path / "report")
    metrics = json.loads((out / "metrics.json").read_text())
    ratio_to = metrics["runs"]["flowtrain"]["ratio_to"]
    assert ratio_to["baseline"]["samples_per_s"] == pytest.approx(flow.samples_per_s() / base.samples_per_s())
    assert ratio_to["baseline-pp1"]["samples_per_s"] == pytest.approx(flow.samples_per_s() / best.samples_per_s())
    assert ratio_to["baseline-pp1"]["samples_per_s"] == pytest.approx(1.6)
    assert metrics["runs"]["flowtrain"]["ratio_to_baseline"] == ratio_to["baseline"]  # the named baseline's
    assert "gantt_baseline-pp1.png" in {p.name for p in out.iterdir()}
    assert table in (out / "summary.md").read_text()


def test_the_thd_and_three_phase_baselines_get_a_ratio_column_each_and_chain_runs_do_not(runs):
    # baseline-thd: measured steps of 1.25 s -> 3.2 samples/s (flowtrain 1.25x); three-phase: 1.6 s -> 2.5 (1.60x);
    # the chain's varlen run (not a baseline) gets no column of its own
    base, flow = runs
    thd, phased = _run("baseline-thd", [5.0, 1.25, 1.25], padded=False), _run("three-phase", [5.0, 1.6, 1.6], padded=False)
    varlen = _chain_step("varlen", [5.0, 1.5, 1.5], "baseline", "varlen attention")
    table = format_table([base, thd, phased, varlen, flow])
    header = table.splitlines()[0].split()
    assert header[5:11] == ["x", "baseline", "x", "baseline-thd", "x", "three-phase"]
    assert [c.strip() for c in _row(table, "flowtrain") if c.strip()][5:8] == ["2.00x", "1.25x", "1.60x"]
    assert ("flowtrain: 2.00x baseline (baseline layout); 1.25x baseline-thd (baseline-thd layout); "
            "1.60x three-phase (three-phase layout)") in table.splitlines()
    metrics = metrics_json([base, thd, phased, varlen, flow])
    assert set(metrics["runs"]["flowtrain"]["ratio_to"]) == {"baseline", "baseline-thd", "three-phase"}
    assert metrics["runs"]["flowtrain"]["ratio_to"]["baseline-thd"]["samples_per_s"] == pytest.approx(1.25)


def _chain_step(name: str, step_times: list[float], previous: str, adds: str) -> RunRecord:
    return dataclasses.replace(_run(name, step_times, padded=False), ablation_previous=previous, ablation_adds=adds)


def test_bought_is_each_chain_runs_samples_per_s_over_the_run_before_and_names_the_largest_gain(runs, tmp_path):
    # measured steps of 2 s (baseline), 2.5 s (packing), 1 s (varlen), 0.8 s (flowtrain), 0.5 s (text-only):
    # 8 samples each -> 2.0, 1.6, 4.0, 5.0, 8.0 samples/s; bought: 1.6/2 = 0.80x, 4/1.6 = 2.50x, 5/4 = 1.25x
    base = runs[0]
    packing = _chain_step("packing", [5.0, 2.5, 2.5], "baseline", "packing")
    varlen = _chain_step("varlen", [5.0, 1.0, 1.0], "packing", "varlen attention")
    flow = _chain_step("flowtrain", [4.0, 0.8, 0.8], "conv-matmul", "the decoupled layout")  # conv-matmul absent
    text = _run("text-only", [4.0, 0.5, 0.5], padded=False)
    records = [base, packing, varlen, flow, text]
    rates = {r.name: r.samples_per_s() for r in records}
    assert rates == pytest.approx({"baseline": 2.0, "packing": 1.6, "varlen": 4.0, "flowtrain": 5.0,
                                   "text-only": 8.0})
    assert bought(records) == {"packing": pytest.approx(throughput_ratio(packing, base)),
                               "varlen": pytest.approx(throughput_ratio(varlen, packing))}
    table = format_table(records)
    header = table.splitlines()[0]

    def cell(run: str, column: str) -> str:  # numbers are right-aligned under their header
        line = next(line for line in table.splitlines() if line.startswith(run + " "))
        return line[:header.index(column) + len(column)].split()[-1]

    assert [cell(r.name, "bought") for r in records] == ["-", "0.80x", "2.50x", "-", "-"]
    assert [cell(r.name, "of text-only") for r in records] == ["25%", "20%", "50%", "62%", "100%"]
    assert largest_gain(records) is varlen
    assert "the largest gain came from varlen attention: varlen is 2.50x packing" in table.splitlines()
    assert any(line.startswith("flowtrain reaches 62% of the text-only throughput") for line in table.splitlines())
    metrics = json.loads((write_report(records, tmp_path / "report") / "metrics.json").read_text())
    for r in (packing, varlen):
        entry = metrics["runs"][r.name]
        assert entry["bought"]["samples_per_s"] == pytest.approx(
            entry["derived"]["samples_per_s"] / metrics["runs"][r.ablation_previous]["derived"]["samples_per_s"])
        assert (entry["bought"]["previous"], entry["bought"]["adds"]) == (r.ablation_previous, r.ablation_adds)
    assert "bought" not in metrics["runs"]["flowtrain"] and "bought" not in metrics["runs"]["baseline"]
    assert metrics["largest_gain"] == {"run": "varlen", "adds": "varlen attention",
                                       "samples_per_s": pytest.approx(2.5)}
    assert metrics["runs"]["flowtrain"]["fraction_of_text_only"]["samples_per_s"] == pytest.approx(5.0 / 8.0)
    assert read_records(tmp_path / "report" / "metrics.json") == records
    plain = format_table(runs).splitlines()[0].split()  # no chain, no bound: no such columns
    assert "bought" not in plain and "text-only" not in plain
    with pytest.raises(MetricsError, match="ablation_previous and ablation_adds come together"):
        dataclasses.replace(packing, ablation_adds=None)


def test_loss_over_training_time_sums_the_step_times(runs):
    assert runs[0].elapsed() == pytest.approx([5.0, 7.0, 9.0])
    assert runs[1].elapsed() == pytest.approx([4.0, 5.0, 6.0])


def test_write_report_writes_every_file_with_the_records_numbers(runs, tmp_path):
    import matplotlib.image

    parity = ParityResult.compare([1, 2, 3], runs[0].losses(), runs[1].losses())
    resume = ResumeResult.compare("flowtrain", 1, [1, 2, 3], runs[1].losses(), runs[1].losses())
    out = write_report(runs, tmp_path / "report", parity=parity, resume=resume)
    names = {"metrics.json", "summary.md", "loss_curves.png", "gantt_baseline.png", "gantt_flowtrain.png",
             "memory.png"}
    assert {p.name for p in out.iterdir()} == names
    for png in out.glob("*.png"):
        pixels = matplotlib.image.imread(png)
        assert pixels.ndim == 3 and pixels.shape[0] > 100 and pixels.shape[1] > 100
        assert pixels.min() < pixels.max(), f"{png.name} is blank"
    metrics = json.loads((out / "metrics.json").read_text())
    for run in runs:
        entry = metrics["runs"][run.name]
        assert entry["derived"]["samples_per_s"] == run.samples_per_s()
        assert entry["derived"]["tokens_per_s"] == run.tokens_per_s()
        assert entry["derived"]["padding_fraction"] == run.padding_fraction()
        assert [r["idle_fraction"] for r in entry["record"]["ranks"]] == [r.idle_fraction for r in run.ranks]
    assert metrics["runs"]["flowtrain"]["ratio_to_baseline"]["samples_per_s"] == pytest.approx(2.0)
    assert metrics["parity"]["passed"] is True and metrics["resume"]["stop_step"] == 1
    assert read_records(out / "metrics.json") == runs
    summary = (out / "summary.md").read_text()
    assert parity.verdict() in summary and resume.verdict() in summary
    assert format_table(runs) in summary and "flowtrain plan\nline 2" in summary


def test_a_parity_only_report_draws_what_ran(tmp_path):
    parity = ParityResult.compare([1, 2], [2.0, 1.5], [2.0, 1.6])
    out = write_report([], tmp_path, parity=parity)
    assert sorted(p.name for p in out.iterdir()) == ["loss_curves.png", "metrics.json", "summary.md"]
    summary = (out / "summary.md").read_text()
    assert "parity FAIL" in summary and "resume: not run" in summary
    assert json.loads((out / "metrics.json").read_text())["parity"]["flowtrain"] == [2.0, 1.6]


def test_gantt_draws_one_bar_per_interval_where_it_ran(runs, tmp_path):
    run = runs[0]
    bars = timeline_gantt(run, tmp_path / "g.png")
    assert len(bars) == len(run.timeline) == 5
    for bar, iv in zip(bars, run.timeline):
        assert bar.get_x() == pytest.approx(iv.start) and bar.get_width() == pytest.approx(iv.end - iv.start)
        # compute fills its rank's row; a transfer is a thin bar at the bottom of it
        centre = bar.get_y() + bar.get_height() / 2
        assert round(centre) == iv.rank and (bar.get_height() > 0.5) == iv.is_compute
    assert (tmp_path / "g.png").stat().st_size > 5000
    # the axis ends at the last interval (1.8 s, rank 0's SEND) or at the span the report shares between runs
    assert bars[0].axes.get_xlim() == pytest.approx((0.0, 1.8 * 1.01))
    shared = timeline_gantt(run, tmp_path / "g2.png", span=4.0)
    assert shared[0].axes.get_xlim() == pytest.approx((0.0, 4.0 * 1.01))


@pytest.mark.parametrize("make, message", [
    (lambda: Interval(0, "llm", "F", 0, -0.1, 0.5), "start is negative"),
    (lambda: Interval(0, "llm", "X", 0, 0.0, 0.5), "unknown kind 'X'"),
    (lambda: Interval(0, "audio", "F", 0, 0.0, 0.5), "unknown region 'audio'"),
    (lambda: Interval(0, "llm", "F", 0, 0.6, 0.5), "ends at 0.5 s before it starts at 0.6 s"),
    (lambda: StepOutcome(1, 1.0, 1, 10, 5, 1.0), r"padded_tokens \(5\) < real tokens \(10\)"),
    (lambda: StepOutcome(2, 1.0, 1, 10, 10, -1.0), "step_s is negative"),
    (lambda: StepOutcome(1, 1.0, 1, 10, 10, 1.0, [Interval(0, "llm", "F", 0, 0.0, 2.0)]), "ends after the step"),
    (lambda: RankRecord(0, "r", 1.0, 3.0, 2.0, 0.0), "busy 3.0 s exceeds the step time"),
    (lambda: RankRecord(0, "r", 1.0, 1.0, 2.0, 0.1), "idle_fraction 0.1 is not 1 - busy/step"),
])
def test_bad_record_is_refused_naming_the_problem(make, message):
    with pytest.raises(MetricsError, match=message):
        make()


def test_bad_json_entry_is_named_by_its_path(runs):
    data = runs[0].to_json()
    data["steps"][1]["intervals"][2]["kind"] = "SLEEP"
    with pytest.raises(MetricsError, match=r"run 'baseline' steps\[1\]\.intervals\[2\]: .*unknown kind 'SLEEP'"):
        RunRecord.from_json(data)
    data = runs[0].to_json()
    data["ranks"][0]["colour"] = "red"
    with pytest.raises(MetricsError, match=r"ranks\[0\]: unknown key\(s\) \['colour'\]"):
        RunRecord.from_json(data)
    data = runs[0].to_json()
    del data["steps"][2]["loss"]
    with pytest.raises(MetricsError, match=r"run 'baseline' steps\[2\]: .*missing .*'loss'"):
        RunRecord.from_json(data)


def test_run_names_must_be_distinct_file_names(runs, tmp_path):
    with pytest.raises(ValueError, match="distinct"):
        write_report([runs[0], runs[0]], tmp_path)
