"""The main job: every phase in ONE launch of the ranks (megatron-core's import alone costs
seconds per rank, so the phases share it).

Phases, in order (``cli`` picks which):

1. the runs (:mod:`mindspeed_flow.train.runs`), each for ``steps`` steps over the same
   samples from the same initialisation, in the catalogue's order: ``baseline`` (the
   MindSpeed-MM-style run), ``baseline-pp<N>[-mbs<M>]`` when ``layout.best_baseline_pp`` or
   ``layout.best_baseline_micro_batch_size`` is set (the baseline at its best configuration),
   ``baseline-thd`` (packed THD Megatron) and ``three-phase`` (the --hetero-parallel / MIMO
   schedule), each at its best PP (``layout.best_thd_pp``, ``layout.best_three_phase_pp``),
   the ablation chain's ``packing``, ``varlen``,
   ``conv-matmul``, then ``flowtrain`` (the ``--use-flowtrain`` run: after step ``resume_at``
   each rank writes a checkpoint - its trainer's model, optimizer and RNG state, and the
   feed's loader state - to ``checkpoint_dir``), and ``text-only`` (the upper bound).  A
   plain invocation trains :data:`~mindspeed_flow.train.runs.DEFAULT_RUNS`; ``--ablation``
   every run (``baseline-pp<N>`` included); ``--search-baselines`` the baselines' grid
   (:mod:`mindspeed_flow.train.search`) and ``flowtrain``, without phases 2 and 3, and
   writes the winners as the ``layout.best_*`` keys (``best_baselines.yaml``).
2. ``parity``: the baseline and flowtrain again for ``parity_steps`` steps in parity mode
   (fed the same packs); their step losses must agree
   (:class:`~mindspeed_flow.train.metrics.ParityResult`).
3. ``resume``: a new flowtrain trainer and a new feed load that checkpoint from disk and
   train steps ``resume_at + 1 .. steps``; the losses must equal the uninterrupted run's
   bit for bit, and the samples fed after the resume must be exactly the uninterrupted
   run's (none repeated, none skipped).

The parent shows one progress bar per phase (loss, samples/s), prints the collected upstream
warnings once, the report table and the verdicts, and writes the report folder.  A failed
parity or resume check makes the command exit non-zero.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from mindspeed_flow.train.runs import BASELINE, DEFAULT_RUNS, FLOWTRAIN, RUN_NAMES, catalogue, select

if TYPE_CHECKING:
    from mindspeed_flow.train.config import TrainConfig
    from mindspeed_flow.train.feed import StepFeed
    from mindspeed_flow.train.launch import DistEnv
    from mindspeed_flow.train.metrics import ParityResult, ResumeResult, RunRecord
    from mindspeed_flow.train.runs import RunSpec

RESUME_RUN = FLOWTRAIN
PARITY_RUNS = (BASELINE, FLOWTRAIN)
CHECKPOINT_FILE = "rank{rank:03d}.pt"
BEST_KEYS_FILE = "best_baselines.yaml"  # --search-baselines: the layout.best_* keys measured (train/search.py)


@dataclass(frozen=True)
class Phases:
    """What one invocation runs: the names of the runs (:func:`runs.select` resolves them
    against the config), the parity phase, the resume phase."""

    runs: tuple[str, ...] = DEFAULT_RUNS
    parity: bool = True
    resume: bool = True
    search: bool = False  # --search-baselines: the baselines' grid (train/search.py) before the runs

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Phases":
        if args.parity:
            return cls(runs=(), parity=True, resume=False)
        if getattr(args, "search_baselines", False):
            return cls(runs=(FLOWTRAIN,), parity=False, resume=False, search=True)
        if args.only:
            return cls(runs=(args.only,), parity=False,
                       resume=args.only == RESUME_RUN and not args.no_resume_check)
        return cls(runs=RUN_NAMES if args.ablation else DEFAULT_RUNS, parity=True, resume=not args.no_resume_check)

    def specs(self, cfg: "TrainConfig") -> list["RunSpec"]:
        """The runs this invocation trains, in order: the search grid (with
        ``--search-baselines``), then the named runs in the catalogue's order."""
        from mindspeed_flow.train.search import search_grid

        return (search_grid(cfg) if self.search else []) + select(cfg, self.runs)

    def with_best_baseline(self, cfg: "TrainConfig") -> "Phases":
        """The best-configuration baseline too, when the config names one and every run
        trains (``--ablation``; the default job leaves it out to stay within its time budget,
        ``--only`` and ``--parity`` keep their single phase)."""
        best = cfg.best_baseline()
        if best is None or not set(RUN_NAMES) <= set(self.runs):
            return self
        return dataclasses.replace(self, runs=(*self.runs, best[0]))


@dataclass
class RankRun:
    """What one rank hands back for one run."""

    name: str
    steps: list  # StepOutcome per step
    rank_record: Any  # RankRecord
    info: dict = field(default_factory=dict)  # layout, features, plan_text, device
    sample_ids: list[list[str]] = field(default_factory=list)  # per step
    seconds: float = 0.0


@dataclass
class RankResult:
    """Everything one rank hands back: its part of each phase, and when its worker started
    and ended (wall clock, so the parent can tell start-up and tear-down from training)."""

    runs: dict[str, RankRun]
    started_at: float
    finished_at: float


# ---------------------------------------------------------------------- on every rank


def _train(spec: "RunSpec", env: "DistEnv", emit: Callable, *, phase: str, parity: bool = False,
           steps: int, checkpoint_at: Optional[int] = None, resume_from: Optional[Path] = None) -> RankRun:
    """Build the run's trainer and a feed, train up to global step ``steps`` and close."""
    from mindspeed_flow.train.feed import StepFeed
    from mindspeed_flow.train.trainer import build_trainer

    cfg = spec.cfg
    started = time.perf_counter()
    trainer = build_trainer(spec.kind, cfg, env, parity=parity, switches=spec.features)
    try:
        # the flow's frozen ViT runs ahead: every rank gets the next step's data too
        feed = StepFeed(cfg, env, lookahead=spec.kind == FLOWTRAIN and cfg.layout.flow and cfg.model.freeze_vit)
        if resume_from is not None:
            _load_checkpoint(resume_from, trainer, feed, env)
        first = feed.step + 1
        emit({"phase": phase, "start": first - 1, "total": steps})
        outcomes, ids = [], []
        for _ in range(first, steps + 1):
            data = feed.next()
            if data.step == steps:
                data.ahead = None  # nothing runs ahead past the run's last step
            outcome = trainer.train_step(data)
            outcomes.append(outcome)
            ids.append(data.sample_ids)
            emit({"phase": phase, "step": outcome.step, "loss": outcome.loss, "samples": outcome.samples,
                  "step_s": outcome.step_s})
            if checkpoint_at == data.step:
                _save_checkpoint(cfg.checkpoint_path, trainer, feed, env, cfg)
        record = trainer.rank_record()
        info = {"layout": trainer.layout, "features": list(trainer.features), "plan_text": trainer.plan_text,
                "timeline_from_end": trainer.timeline_from_end,
                "device": env.device.type}
    finally:
        trainer.close()
    return RankRun(phase, outcomes, record, info, ids, time.perf_counter() - started)


def _save_checkpoint(directory: Path, trainer: Any, feed: "StepFeed", env: "DistEnv", cfg: "TrainConfig") -> None:
    """This rank's checkpoint, written atomically (temp file, then rename)."""
    import torch

    from mindspeed_flow.train.config import as_dict

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / CHECKPOINT_FILE.format(rank=env.rank)
    tmp = path.with_suffix(".tmp")
    torch.save({"step": feed.step, "world_size": env.world_size, "config": as_dict(cfg),
                "trainer": trainer.state_dict(), "feed": feed.state_dict()}, tmp)
    os.replace(tmp, path)


def _load_checkpoint(directory: Path, trainer: Any, feed: "StepFeed", env: "DistEnv") -> None:
    import torch

    path = directory / CHECKPOINT_FILE.format(rank=env.rank)
    if not path.exists():
        raise FileNotFoundError(f"resume: no checkpoint for rank {env.rank} at {path}")
    state = torch.load(path, map_location=env.device, weights_only=False)
    if state["world_size"] != env.world_size:
        raise ValueError(f"resume: {path} was written by a {state['world_size']}-rank job, this one has "
                         f"{env.world_size} ranks")
    trainer.load_state_dict(state["trainer"])
    feed.load_state_dict(state["feed"])


def rank_main(env: "DistEnv", emit: Callable, cfg: "TrainConfig", phases: Phases) -> RankResult:
    """Every phase on this rank (the launched worker)."""
    started_at = time.time()
    out: dict[str, RankRun] = {}
    checkpoint_at = cfg.resume_at if phases.resume else None
    runs = catalogue(cfg)
    for spec in phases.specs(cfg):
        out[spec.name] = _train(spec, env, emit, phase=spec.name, steps=cfg.steps,
                                checkpoint_at=checkpoint_at if spec.name == RESUME_RUN else None)
    if phases.parity:
        for name in PARITY_RUNS:
            out[f"parity-{name}"] = _train(runs[name], env, emit, phase=f"parity {name}", parity=True,
                                           steps=cfg.parity_steps)
    if phases.resume:
        if RESUME_RUN not in out:  # the uninterrupted run, with its checkpoint
            out[RESUME_RUN] = _train(runs[RESUME_RUN], env, emit, phase=RESUME_RUN, steps=cfg.steps,
                                     checkpoint_at=cfg.resume_at)
        out["resume"] = _train(runs[RESUME_RUN], env, emit, phase="resume", steps=cfg.steps,
                               resume_from=cfg.checkpoint_path)
    return RankResult(out, started_at, time.time())


# ---------------------------------------------------------------------- in the parent


class Progress:
    """One tqdm bar per phase, fed by rank 0's step events."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.bar = None

    def __call__(self, event: dict) -> None:
        from tqdm import tqdm

        if "total" in event:
            self.close()
            self.bar = tqdm(total=event["total"], initial=event["start"], desc=f"{event['phase']:>18}", unit="step",
                            file=self.stream, dynamic_ncols=True, leave=True)
        elif self.bar is not None:
            rate = event["samples"] / event["step_s"] if event["step_s"] > 0 else 0.0
            self.bar.set_postfix_str(f"loss {event['loss']:.4f}, {rate:.1f} samples/s", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def run_record(spec: "RunSpec", ranks: list[RankRun], world_size: int) -> "RunRecord":
    """The report's record of one run from every rank's part: rank 0's steps, one record
    per rank, every rank's intervals of the last (measured) step as the timeline (the
    trainer's ``timeline_from_end``-th from the end: the flow's frozen ViT runs ahead in every
    step but the last), and the
    run's place in the ablation chain."""
    from mindspeed_flow.train.metrics import RunRecord

    first = ranks[0]
    back = min(first.info.get("timeline_from_end", 1), len(first.steps)) or 1
    timeline = [iv for r in ranks if r.steps for iv in r.steps[-back].intervals]
    return RunRecord(name=spec.name, layout=first.info["layout"], world_size=world_size,
                     features=first.info["features"], plan_text=first.info["plan_text"], steps=first.steps,
                     ranks=[r.rank_record for r in ranks], timeline=timeline, device=first.info["device"],
                     ablation_previous=spec.previous, ablation_adds=spec.adds)


def compare_parity(results: list[RankResult]) -> "ParityResult":
    """Rank 0's parity losses of both runs, step by step (every rank reports the same,
    all-reduced, step loss, so rank 0's are the runs')."""
    from mindspeed_flow.train.metrics import ParityResult

    base, flow = (results[0].runs[f"parity-{name}"] for name in PARITY_RUNS)
    return ParityResult.compare([s.step for s in base.steps], [s.loss for s in base.steps],
                                [s.loss for s in flow.steps])


def compare_resume(results: list[RankResult], cfg: "TrainConfig") -> tuple["ResumeResult", bool]:
    """Resumed curve = the uninterrupted run's losses up to the stop, then the resumed run's;
    a repeated sample is one fed more often (before the stop and after the resume together)
    than the uninterrupted run fed it; samples fed in another order or skipped fail too."""
    from mindspeed_flow.train.metrics import ResumeResult

    whole, resumed = results[0].runs[RESUME_RUN], results[0].runs["resume"]
    k = cfg.resume_at
    losses = [s.loss for s in whole.steps]
    curve = losses[:k] + [s.loss for s in resumed.steps]
    before = [sid for step in whole.sample_ids[:k] for sid in step]
    after = [sid for step in resumed.sample_ids for sid in step]
    expected = [sid for step in whole.sample_ids[k:] for sid in step]
    repeated = sorted((Counter(before + after) - Counter(before + expected)).elements())
    result = ResumeResult.compare(RESUME_RUN, k, [s.step for s in whole.steps], losses, curve,
                                  repeated_samples=repeated)
    same_samples = after == expected
    if not same_samples and result.passed:
        result = dataclasses.replace(result, passed=False)
    return result, same_samples


def remove_leftover_pools(pids: list[int]) -> None:
    """The shm pools of the flowtrain phases are named after rank 0's pid; a rank stopped
    before its trainer's ``close()`` leaves their segments in /dev/shm."""
    from mindspeed_flow.pool.shm import destroy
    from mindspeed_flow.train.flow import pool_prefix

    if pids:
        destroy(pool_prefix(pids[0]))


def main(args: argparse.Namespace) -> int:
    """``mindspeed-flow train``: see the module docstring."""
    from mindspeed_flow.train.config import ConfigError, as_dict, check_resume, load_config
    from mindspeed_flow.train.feed import with_tokenizer
    from mindspeed_flow.train.launch import RankFailed, run_world
    from mindspeed_flow.train.warnings_log import summary

    phases = Phases.from_args(args)
    try:
        cfg = load_config(args.config, steps=args.steps, world_size=args.nproc,
                          report_dir=str(args.report) if args.report is not None else None)
        if phases.resume:
            check_resume(cfg, args.config)
    except ConfigError as exc:
        print(f"mindspeed-flow train: {exc}", file=sys.stderr)
        return 2
    try:
        cfg = with_tokenizer(cfg)  # makes the demo corpus first (data.make_demo), before the ranks start
    except ConfigError as exc:  # data.path missing (and no data.make_demo) or empty
        print(f"mindspeed-flow train: {args.config}: {exc}", file=sys.stderr)
        return 2
    phases = phases.with_best_baseline(cfg)
    print(f"mindspeed-flow train {args.config}: {cfg.layout.world_size} ranks, {cfg.steps} steps; phases: "
          f"{', '.join(s.name for s in phases.specs(cfg)) or '-'}{', parity' if phases.parity else ''}{', resume' if phases.resume else ''}",
          flush=True)
    progress = Progress()
    started, launched_at = time.perf_counter(), time.time()
    try:
        launched = run_world(rank_main, cfg.layout.world_size, cfg, phases, on_event=progress,
                             after_stop=remove_leftover_pools)
    except RankFailed as exc:
        progress.close()
        print(f"mindspeed-flow train: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        progress.close()
        print("mindspeed-flow train: interrupted; every rank was stopped", file=sys.stderr)
        return 130
    finally:
        progress.close()
    if launched is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    results, noise = launched
    timing = {"ranks_ready_s": max(r.started_at for r in results) - launched_at,
              "ranks_stopped_s": time.time() - max(r.finished_at for r in results),
              "launch_wall_s": time.perf_counter() - started}
    print(summary(noise, cfg.layout.world_size))
    return _report(cfg, phases, results, noise, timing, as_dict(cfg))


def _report(cfg: "TrainConfig", phases: Phases, results: list[RankResult], noise: Any, timing: dict[str, float],
            config: dict) -> int:
    from mindspeed_flow.train.report import bought, format_table, write_report
    from mindspeed_flow.train.search import best_config_lines, best_of_search, family_of, search_json, search_lines

    world = cfg.layout.world_size
    specs = phases.specs(cfg)
    records = [run_record(spec, [r.runs[spec.name] for r in results], world) for spec in specs]
    out = Path(cfg.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    if phases.search:  # each baseline family at its best configuration, under its own name
        grid = [r for r in records if family_of(r.name) is not None]
        keys = best_config_lines(cfg, grid)
        print("\n".join(search_lines(grid) + [f"to run each baseline at its best in the default job and --ablation, "
                                                f"put these keys in the config's layout (also in {BEST_KEYS_FILE}):"]
                         + keys))
        (out / "baseline_search.json").write_text(json.dumps(search_json(grid), indent=1) + "\n")
        (out / BEST_KEYS_FILE).write_text("\n".join(keys) + "\n")
        records = best_of_search(grid) + [r for r in records if family_of(r.name) is None]
    parity = compare_parity(results) if phases.parity else None
    resume, same_samples = compare_resume(results, cfg) if phases.resume else (None, True)
    if records:
        print(format_table(records))
        if len(records) > 1 and not bought(records) and not phases.search:
            print("what each feature buys, one at a time (the ablation chain baseline -> packing -> varlen -> "
                  "conv-matmul -> flowtrain): add --ablation")
    write_report(records, out, parity=parity, resume=resume)
    phase_s = {name: max(r.runs[name].seconds for r in results) for name in results[0].runs}
    switches = {spec.name: dataclasses.asdict(spec.features) for spec in specs}
    (out / "job.json").write_text(json.dumps({"config": config, **timing, "phase_s": phase_s, "ranks": world,
                                              "run_switches": switches, "resume_same_samples": same_samples},
                                             indent=1) + "\n")
    (out / "warnings.json").write_text(json.dumps(noise.to_json(), indent=1) + "\n")
    failed = []
    for check in (parity, resume):
        if check is not None:
            print(check.verdict())
            failed += [] if check.passed else [check]
    if resume is not None and not same_samples:
        print("resume FAIL: the samples fed after the resume differ from the uninterrupted run's")
    print(f"report: {out}/ (ranks: {timing['launch_wall_s']:.1f} s, of which start-up {timing['ranks_ready_s']:.1f} s, "
          f"phases {sum(phase_s.values()):.1f} s)")
    return 1 if failed else 0
