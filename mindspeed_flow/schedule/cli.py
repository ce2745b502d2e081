"""``mindspeed-flow simulate CONFIG...``: compare schedules on paper-scale configs.

The lead's ``mindspeed_flow/cli.py`` calls :func:`register` with its subparsers; the
subcommand prints one comparison table per config and writes one Gantt chart per schedule.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import yaml

from .errors import ScheduleError
from .scenarios import format_table, load, run


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``simulate`` subcommand; its ``func`` takes the parsed args, returns an exit code."""
    parser = subparsers.add_parser(
        "simulate",
        help="simulate pipeline schedules of a config and compare them",
        description=(
            "Compose, validate and simulate every schedule of each CONFIG (configs/sim/*.yaml), "
            "print a comparison table and draw one Gantt chart per schedule."
        ),
    )
    parser.add_argument("configs", nargs="+", metavar="CONFIG", type=Path, help="a YAML config")
    parser.add_argument("--charts", type=Path, default=Path("outputs/sim"),
                        help="folder for the charts, one subfolder per config (default: %(default)s)")
    parser.add_argument("--no-charts", action="store_true", help="print the tables only")
    parser.add_argument("--seeds", type=int, help="steps simulated per schedule (overrides the config)")
    parser.set_defaults(func=simulate_command)


def simulate_command(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Run the subcommand; ``argv`` (the raw arguments, passed by the top-level CLI) is not
    needed here."""
    for path in args.configs:
        try:
            config = load(path)
            if args.seeds is not None:
                config = {**config, "seeds": args.seeds}
            charts = None if args.no_charts else args.charts / path.stem
            rows = run(config, charts)
        except (OSError, yaml.YAMLError, ScheduleError) as error:
            print(f"simulate: {path}: {error}", file=sys.stderr)
            return 1
        print(format_table(f"{config.get('name', path.stem)} ({path})", rows))
        if charts is not None:
            print(f"charts: {charts}/<schedule>.png")
        print()
    return 0
