"""What a training run measured, as plain JSON-serialisable records, and the rates derived from them.

The runs (baseline and flowtrain) fill these records on every rank; the job gathers them and
hands them to :mod:`mindspeed_flow.train.report`.  Keeping the measurement separate from the
drawing lets the report be rebuilt from ``metrics.json`` alone (``RunRecord.from_json``).

Rules for the derived numbers (the report's table states them too):

* **Warm-up.**  The first step of a run pays for allocator warm-up, lazy initialisation and
  first-touch of every buffer, so rates use the *measured steps*: every step but the first.
  A run of a single step has nothing else to measure and uses that step.
* ``samples_per_s`` = samples of the measured steps / their summed step time; ``tokens_per_s``
  the same with real (non-padding) tokens.
* ``padding_fraction`` = 1 - real tokens / computed (padded) tokens over *every* step (padding
  does not depend on timing, so the warm-up step counts).
* A rank's ``idle_fraction`` = 1 - busy / step time over the measured steps, where busy is the
  time covered by its compute intervals (F, B, W); transfers, pool traffic and reductions are
  not compute, so a rank waiting on them is idle (the measured pipeline bubble).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Iterable, Sequence

from mindspeed_flow.schedule.regions import BACKBONE_REGION, ENCODER_REGION
from mindspeed_flow.train.errors import MetricsError

REGIONS = (ENCODER_REGION, BACKBONE_REGION)
COMPUTE_KINDS = ("F", "B", "W")
TRANSFER_KINDS = ("PUT", "GET", "SEND", "RECV", "REDUCE")
KINDS = COMPUTE_KINDS + TRANSFER_KINDS
NO_MICROBATCH = -1  # Interval.microbatch of a per-step action (a gradient reduction)
# Idle fractions and interval bounds are sums of float timer readings: allow rounding.
_SLACK = 1e-9


def _check_time(owner: str, name: str, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise MetricsError(f"{owner}: {name} must be a finite number of seconds, got {value!r}")
    if value < 0:
        raise MetricsError(f"{owner}: {name} is negative ({value!r} s); times are measured from the step start")


def _check_count(owner: str, name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise MetricsError(f"{owner}: {name} must be a non-negative int, got {value!r}")


@dataclass
class Interval:
    """One action a rank ran during a step: ``start`` / ``end`` in seconds from that step's start.

    ``region`` is ``"vit"`` or ``"llm"``; ``kind`` one of :data:`KINDS`; ``microbatch`` the
    microbatch index, or :data:`NO_MICROBATCH` for a per-step action such as ``REDUCE``.
    ``ahead``: how many steps later the step whose data this action works on is (the flow's
    frozen encoder encodes the next step's batches during this one: 1), 0 for this step's.
    """

    rank: int
    region: str
    kind: str
    microbatch: int
    start: float
    end: float
    ahead: int = 0

    def __post_init__(self) -> None:
        owner = f"Interval(rank={self.rank}, {self.kind} {self.region} mb{self.microbatch})"
        _check_count(owner, "rank", self.rank)
        if self.kind not in KINDS:
            raise MetricsError(f"{owner}: unknown kind {self.kind!r} (expected one of {', '.join(KINDS)})")
        if self.region not in REGIONS:
            raise MetricsError(f"{owner}: unknown region {self.region!r} (expected one of {', '.join(REGIONS)})")
        if not isinstance(self.microbatch, int) or self.microbatch < NO_MICROBATCH:
            raise MetricsError(f"{owner}: microbatch must be an int >= {NO_MICROBATCH}, got {self.microbatch!r}")
        _check_time(owner, "start", self.start)
        _check_time(owner, "end", self.end)
        if not isinstance(self.ahead, int) or self.ahead < 0:
            raise MetricsError(f"{owner}: ahead must be an int >= 0, got {self.ahead!r}")
        if self.end < self.start:
            raise MetricsError(f"{owner}: ends at {self.end!r} s before it starts at {self.start!r} s")

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS


def busy_seconds(intervals: Iterable[Interval]) -> float:
    """Time covered by the compute intervals (their union, so overlapping ones count once)."""
    spans = sorted((iv.start, iv.end) for iv in intervals if iv.is_compute)
    busy, reach = 0.0, -math.inf
    for start, end in spans:
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy


@dataclass
class StepOutcome:
    """One optimizer step as a rank saw it (``Trainer.train_step``'s return value).

    ``loss``, ``samples``, ``tokens`` (real tokens) and ``padded_tokens`` (tokens computed,
    padding included) are global over all replicas, identical on every rank; ``step_s`` and
    ``intervals`` are this rank's own timing.
    """

    step: int
    loss: float
    samples: int
    tokens: int
    padded_tokens: int
    step_s: float
    intervals: list[Interval] = field(default_factory=list)

    def __post_init__(self) -> None:
        owner = f"StepOutcome(step={self.step})"
        if not isinstance(self.step, int) or self.step < 1:
            raise MetricsError(f"{owner}: step must be a 1-based int, got {self.step!r}")
        if not isinstance(self.loss, (int, float)) or isinstance(self.loss, bool):
            raise MetricsError(f"{owner}: loss must be a number, got {self.loss!r}")
        for name in ("samples", "tokens", "padded_tokens"):
            _check_count(owner, name, getattr(self, name))
        if self.padded_tokens < self.tokens:
            raise MetricsError(f"{owner}: padded_tokens ({self.padded_tokens}) < real tokens ({self.tokens})")
        _check_time(owner, "step_s", self.step_s)
        for iv in self.intervals:
            if iv.end > self.step_s + _SLACK:
                raise MetricsError(f"{owner}: {iv} ends after the step ({self.step_s!r} s)")


def measured(steps: Sequence[StepOutcome]) -> Sequence[StepOutcome]:
    """The steps rates are computed over: all but the first (warm-up) one, unless it is the only one."""
    return steps[1:] if len(steps) > 1 else steps


@dataclass
class RankRecord:
    """One rank of a run: its role, peak memory and how much of the measured steps it computed."""

    rank: int
    role: str
    peak_memory_mb: float
    busy_s: float
    step_s: float
    idle_fraction: float

    def __post_init__(self) -> None:
        owner = f"RankRecord(rank={self.rank}, {self.role!r})"
        _check_count(owner, "rank", self.rank)
        if not isinstance(self.peak_memory_mb, (int, float)) or not self.peak_memory_mb >= 0:
            raise MetricsError(f"{owner}: peak_memory_mb must be >= 0 MB, got {self.peak_memory_mb!r}")
        _check_time(owner, "busy_s", self.busy_s)
        _check_time(owner, "step_s", self.step_s)
        if self.busy_s > self.step_s + _SLACK:
            raise MetricsError(f"{owner}: busy {self.busy_s!r} s exceeds the step time {self.step_s!r} s")
        expected = _idle(self.busy_s, self.step_s)
        if abs(self.idle_fraction - expected) > 1e-6:
            raise MetricsError(f"{owner}: idle_fraction {self.idle_fraction!r} is not 1 - busy/step = {expected!r}"
                               " (build it with RankRecord.measure)")

    @classmethod
    def measure(cls, rank: int, role: str, peak_memory_mb: float, steps: Sequence[StepOutcome]) -> RankRecord:
        """Sum busy (compute) and step time of this rank over the measured steps of ``steps``."""
        kept = measured(steps)
        busy = sum(busy_seconds(s.intervals) for s in kept)
        step = sum(s.step_s for s in kept)
        return cls(rank, role, float(peak_memory_mb), busy, step, _idle(busy, step))


def _idle(busy: float, step: float) -> float:
    return max(0.0, 1.0 - busy / step) if step > 0 else 0.0


@dataclass
class RunRecord:
    """Everything one run (``"baseline"`` or ``"flowtrain"``) measured.

    ``steps`` are rank 0's outcomes (losses and counts are the same on every rank; a step
    ends at a global synchronisation, so its time differs across ranks by one collective);
    ``ranks`` holds one record per rank; ``timeline`` every rank's intervals of one measured
    step, for the Gantt chart; ``device`` what the ranks ran on (``"cpu"``, ``"cuda"``; empty:
    not recorded); ``ablation_previous`` / ``ablation_adds``: the run before this one in the
    ablation chain and the feature this run adds to it (``None`` outside the chain and for
    its first run), what the report's "bought" column divides by.
    """

    name: str
    layout: str
    world_size: int
    features: list[str]
    plan_text: str | None
    steps: list[StepOutcome]
    ranks: list[RankRecord]
    timeline: list[Interval]
    device: str = ""
    ablation_previous: str | None = None
    ablation_adds: str | None = None

    def __post_init__(self) -> None:
        owner = f"RunRecord({self.name!r})"
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise MetricsError(f"{owner}: world_size must be an int >= 1, got {self.world_size!r}")
        for rank in self.ranks:
            if rank.rank >= self.world_size:
                raise MetricsError(f"{owner}: rank record {rank.rank} outside world_size {self.world_size}")
        for iv in self.timeline:
            if iv.rank >= self.world_size:
                raise MetricsError(f"{owner}: timeline interval {iv} on a rank outside world_size {self.world_size}")
        if (self.ablation_previous is None) != (self.ablation_adds is None):
            raise MetricsError(f"{owner}: ablation_previous and ablation_adds come together (the run before in the "
                               f"chain and the feature added), got {self.ablation_previous!r} and {self.ablation_adds!r}")
        numbers = [s.step for s in self.steps]
        if numbers != sorted(set(numbers)):
            raise MetricsError(f"{owner}: steps must be strictly increasing, got {numbers}")

    def _rate(self, count: str) -> float:
        kept = measured(self.steps)
        seconds = sum(s.step_s for s in kept)
        return sum(getattr(s, count) for s in kept) / seconds if seconds > 0 else 0.0

    def samples_per_s(self) -> float:
        """Samples per second over the measured steps (the first, warm-up step excluded)."""
        return self._rate("samples")

    def tokens_per_s(self) -> float:
        """Real (non-padding) tokens per second over the measured steps."""
        return self._rate("tokens")

    def padding_fraction(self) -> float:
        """Share of computed tokens that are padding, over every step."""
        padded = sum(s.padded_tokens for s in self.steps)
        return 1.0 - sum(s.tokens for s in self.steps) / padded if padded else 0.0

    def peak_memory_mb(self) -> float:
        """The largest peak memory of any rank."""
        return max((r.peak_memory_mb for r in self.ranks), default=0.0)

    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    def elapsed(self) -> list[float]:
        """Training time at the end of each step: rank 0's step times summed (the builds,
        feeds' start-up and other phases between runs are not in it)."""
        return list(itertools.accumulate(s.step_s for s in self.steps))

    def derived(self) -> dict[str, float]:
        """The derived rates, as written to ``metrics.json``."""
        return {
            "samples_per_s": self.samples_per_s(),
            "tokens_per_s": self.tokens_per_s(),
            "padding_fraction": self.padding_fraction(),
            "peak_memory_mb": self.peak_memory_mb(),
            "measured_steps": len(measured(self.steps)),
        }

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RunRecord:
        """Inverse of :meth:`to_json`; a bad entry is named by its path (``steps[2].intervals[0]``)."""
        run = f"run {d.get('name')!r}" if isinstance(d, dict) else "run"

        def step(entry: Any, where: str) -> StepOutcome:
            return _build(StepOutcome, entry, where, intervals=lambda v: _intervals(v, f"{where}.intervals"))

        return _build(cls, d, run,
                      steps=lambda v: [step(s, f"{run} steps[{i}]") for i, s in enumerate(v)],
                      ranks=lambda v: [_build(RankRecord, r, f"{run} ranks[{i}]") for i, r in enumerate(v)],
                      timeline=lambda v: _intervals(v, f"{run} timeline"))


def throughput_ratio(run: RunRecord, baseline: RunRecord) -> dict[str, float]:
    """``run`` over ``baseline`` for samples/s and tokens/s (``nan`` where the baseline measured 0)."""
    def over(a: float, b: float) -> float:
        return a / b if b > 0 else math.nan

    return {"samples_per_s": over(run.samples_per_s(), baseline.samples_per_s()),
            "tokens_per_s": over(run.tokens_per_s(), baseline.tokens_per_s())}


def _build(cls: type, d: Any, where: str, **convert: Callable[[Any], Any]) -> Any:
    """``cls(**d)`` from a JSON object, ``convert`` turning nested entries into records first."""
    if not isinstance(d, dict):
        raise MetricsError(f"{where}: expected a JSON object for {cls.__name__}, got {type(d).__name__}")
    unknown = sorted(set(d) - {f.name for f in fields(cls)})
    if unknown:
        raise MetricsError(f"{where}: unknown key(s) {unknown} for {cls.__name__}")
    kw = {k: convert[k](v) if k in convert else v for k, v in d.items()}
    try:
        return cls(**kw)
    except TypeError as e:  # a missing key
        raise MetricsError(f"{where}: {e}") from None
    except MetricsError as e:
        raise MetricsError(f"{where}: {e}") from None


def _intervals(entries: list[Any], where: str) -> list[Interval]:
    return [_build(Interval, iv, f"{where}[{i}]") for i, iv in enumerate(entries)]


def _close(a: float, b: float, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12)


@dataclass
class ParityResult:
    """Parity mode: both runs fed the same packs; their step losses must agree step by step.

    Tolerances (fp32): relative ``rtol_first`` on the first step, ``rtol`` after (the
    optimizer's updates let rounding differences grow a little).
    """

    steps: list[int]
    baseline: list[float]
    flowtrain: list[float]
    max_rel_deviation: float
    passed: bool
    rtol_first: float = 1e-5
    rtol: float = 1e-4

    @classmethod
    def compare(cls, steps: Sequence[int], baseline: Sequence[float], flowtrain: Sequence[float], *,
                rtol_first: float = 1e-5, rtol: float = 1e-4) -> ParityResult:
        if not (len(steps) == len(baseline) == len(flowtrain)) or not steps:
            raise MetricsError(f"ParityResult: need one loss per step on both sides, got {len(steps)} steps, "
                               f"{len(baseline)} baseline and {len(flowtrain)} flowtrain losses")
        rel = [abs(a - b) / max(abs(a), abs(b), 1e-12) for a, b in zip(baseline, flowtrain)]
        passed = all(_close(a, b, rtol_first if i == 0 else rtol)
                     for i, (a, b) in enumerate(zip(baseline, flowtrain)))
        return cls(list(steps), list(map(float, baseline)), list(map(float, flowtrain)), max(rel), passed,
                   rtol_first, rtol)

    def verdict(self) -> str:
        word = "PASS" if self.passed else "FAIL"
        return (f"parity {word}: {len(self.steps)} steps, max relative loss deviation {self.max_rel_deviation:.2e} "
                f"(tolerance {self.rtol_first:g} on step 1, {self.rtol:g} after)")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ParityResult:
        return _build(cls, d, "parity")


@dataclass
class ResumeResult:
    """Checkpoint and resume: a run stopped after ``stop_step`` and resumed must continue exactly.

    ``uninterrupted`` and ``resumed`` are the losses of steps ``steps`` (from step 1): the
    resumed curve is the stopped run's losses up to ``stop_step`` followed by the resumed
    run's.  ``repeated_samples`` lists sample ids the resumed loader fed a second time.
    """

    run: str
    stop_step: int
    steps: list[int]
    uninterrupted: list[float]
    resumed: list[float]
    max_abs_deviation: float
    repeated_samples: list[str]
    passed: bool
    atol: float = 0.0

    @classmethod
    def compare(cls, run: str, stop_step: int, steps: Sequence[int], uninterrupted: Sequence[float],
                resumed: Sequence[float], *, repeated_samples: Sequence[str] = (), atol: float = 0.0) -> ResumeResult:
        if not (len(steps) == len(uninterrupted) == len(resumed)) or not steps:
            raise MetricsError(f"ResumeResult({run!r}): need one loss per step on both sides, got {len(steps)} steps, "
                               f"{len(uninterrupted)} uninterrupted and {len(resumed)} resumed losses")
        if stop_step not in steps[:-1]:
            raise MetricsError(f"ResumeResult({run!r}): stop_step {stop_step} is not a step before the last of {list(steps)}")
        dev = max(abs(a - b) for a, b in zip(uninterrupted, resumed))
        return cls(run, stop_step, list(steps), list(map(float, uninterrupted)), list(map(float, resumed)), dev,
                   list(repeated_samples), dev <= atol and not repeated_samples, atol)

    def verdict(self) -> str:
        word = "PASS" if self.passed else "FAIL"
        exact = "exactly" if self.atol == 0 else f"within {self.atol:g}"
        text = (f"resume {word} ({self.run}): stopped after step {self.stop_step}, resumed to step {self.steps[-1]}; "
                f"max loss deviation from the uninterrupted run {self.max_abs_deviation:.2e} (must match {exact})")
        if self.repeated_samples:
            text += f"; {len(self.repeated_samples)} sample(s) fed twice, e.g. {self.repeated_samples[0]!r}"
        return text

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ResumeResult:
        return _build(cls, d, "resume")
