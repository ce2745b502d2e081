"""``mindspeed-flow train CONFIG``: the main job (baseline, baseline-thd, flowtrain, text-only upper bound,
parity, resume check; ``--ablation``: every run of the ablation chain too).

Only argument parsing lives here; the job and everything heavy is imported when the
subcommand runs, so registering it costs nothing for the other subcommands.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

from mindspeed_flow.train.runs import RUN_NAMES


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train the tiny VLM: baseline vs --use-flowtrain, parity, resume, report",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("config", type=Path, metavar="CONFIG", help="YAML job config (configs/train/demo.yaml)")
    parser.add_argument("--steps", type=int, default=None, metavar="N", help="training steps (overrides the config)")
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument("--only", choices=RUN_NAMES, default=None,
                      help="train only this run (no parity run; the resume check only with flowtrain)")
    runs.add_argument("--ablation", action="store_true",
                      help="every run: the ablation chain baseline -> packing -> varlen -> conv-matmul -> flowtrain "
                           "(one feature at a time), baseline-pp<N> (the configured best baseline) and the text-only "
                           "upper bound, the baseline-thd and three-phase baselines (default: baseline, baseline-thd, flowtrain, text-only)")
    runs.add_argument("--search-baselines", action="store_true",
                      help="search every co-located baseline's best configuration (baseline: PP x micro-batch size; "
                           "baseline-thd, three-phase: PP) on the same samples, in one launch, beside flowtrain; "
                           "the report compares flowtrain with each baseline at its best (baseline_search.json: the "
                           "whole grid; best_baselines.yaml: the layout.best_* lines to paste into the config); "
                           "no parity or resume phase")
    parser.add_argument("--parity", action="store_true",
                        help="only the parity run: both runs fed the same packs, losses asserted equal")
    parser.add_argument("--no-resume-check", action="store_true", help="skip the checkpoint/resume check")
    parser.add_argument("--report", type=Path, default=None, metavar="DIR",
                        help="report folder (overrides report_dir of the config)")
    parser.add_argument("--nproc", type=int, default=None, metavar="N",
                        help="number of processes (overrides layout.world_size)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    from mindspeed_flow.train.job import main as job_main

    return job_main(args)
