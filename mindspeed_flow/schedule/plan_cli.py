"""``mindspeed-flow plan dump|check``: plans as files to edit by hand.

``dump CONFIG SCHEDULE`` composes one schedule of a simulation config (``configs/sim``) and
writes its text (:mod:`.listing`); ``check FILE`` reads a plan file back, validates it and
prints its steps-by-ranks grid, or with ``--against OTHER`` the grid of differences.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import yaml

from .errors import ScheduleError
from .listing import dump, dumps, format_grid
from .listing import load as load_plan
from .scenarios import load, scenario_plan
from .validate import validate


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``plan`` subcommand with its ``dump`` and ``check`` actions."""
    parser = subparsers.add_parser(
        "plan",
        help="write a composed schedule as text, or check and diff a (hand-edited) plan file",
        description="Plans as text: dump one schedule of a config, edit it, check it again.",
    )
    actions = parser.add_subparsers(dest="plan_command", required=True)
    dump = actions.add_parser("dump", help="compose one schedule of a config and write it as text")
    dump.add_argument("config", type=Path, help="a configs/sim YAML file")
    dump.add_argument("schedule", help="the name of one of its schedules")
    dump.add_argument("-o", "--output", type=Path, help="file to write (default: standard output)")
    dump.add_argument("--semantics", choices=("eager", "rendezvous"), default="eager")
    check = actions.add_parser("check", help="validate a plan file and print its steps-by-ranks grid")
    check.add_argument("plan", type=Path, help="a file written by `plan dump` (edited or not)")
    check.add_argument("--against", type=Path, help="another plan file: print the grid of differences")
    check.add_argument("--semantics", choices=("eager", "rendezvous"),
                       help="check under these semantics (default: the file's)")
    parser.set_defaults(func=plan_command)


def plan_command(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Run ``plan dump`` or ``plan check``; faults go to standard error with exit code 1."""
    try:
        if args.plan_command == "dump":
            return _dump(args)
        return _check(args)
    except (OSError, yaml.YAMLError, ScheduleError) as error:
        print(f"plan {args.plan_command}: {error}", file=sys.stderr)
        return 1


def _dump(args: argparse.Namespace) -> int:
    config = load(args.config)
    schedules = {s.get("name"): s for s in config.get("schedules", [])}
    if args.schedule not in schedules:
        raise ScheduleError(f"{args.config}: no schedule {args.schedule!r}, expected one of {sorted(schedules)}")
    plan = scenario_plan(config, schedules[args.schedule], semantics=args.semantics)
    if args.output is None:
        sys.stdout.write(dumps(plan))
    else:
        dump(plan, args.output)
        print(f"wrote {args.output}")
    return 0


def _check(args: argparse.Namespace) -> int:
    plan = load_plan(args.plan)
    validate(plan, semantics=args.semantics)
    print(f"{args.plan}: valid under {args.semantics or plan.semantics} semantics, "
          f"{sum(len(p) for p in plan.programs.values())} actions on {len(plan.programs)} ranks")
    print(format_grid(plan, load_plan(args.against) if args.against else None))
    return 0
