"""``mindspeed-flow plan CONFIG`` (also ``allocate CONFIG``): solve an allocator config and
print the plan.  ``plan dump|check`` belong to the schedule package; ``mindspeed_flow.cli``
sends ``plan`` with any other first argument here."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import AllocatorError, InfeasibleError
from .profile import Profile
from .proxy import ProxyModel
from .report import describe, draw_rate_match
from .solve import solve
from .specs import load_config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "allocate", help="choose encoder and backbone parallel configs (HiGHS MILP) and print the plan "
                         "(also: plan CONFIG)",
        description="Solve an allocator config (configs/allocator/*.yaml): the plan, predicted samples/s and "
                    "MFU, production/consumption rates, alternatives and the upstream arguments.")
    parser.add_argument("config", type=Path, help="allocator YAML (model, cluster, workload, profile)")
    parser.add_argument("--devices", type=int, help="override the cluster's device budget")
    parser.add_argument("--alternatives", type=int, help="override how many alternatives to show")
    parser.add_argument("--out", type=Path, help="write the plan (YAML or .json) for --flow-allocator-plan")
    parser.add_argument("--png", type=Path, help="draw the rate match to this PNG")
    parser.add_argument("--verbose", action="store_true", help="let HiGHS print its banner and solve log")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, _argv: list[str]) -> int:
    from dataclasses import replace

    try:
        config = load_config(args.config)
        if args.devices is not None:
            config = replace(config, cluster=replace(config.cluster, devices=args.devices))
        if args.alternatives is not None:
            config = replace(config, workload=replace(config.workload, alternatives=args.alternatives))
        profile = Profile.load(config.profile)
        proxy = ProxyModel(profile, config.cluster)
        plan = solve(config.model, config.cluster, proxy, config.workload, verbose=args.verbose)
    except InfeasibleError as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 2
    except (AllocatorError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    title = (f"plan for {config.model.name} on {config.cluster.devices} devices ({args.config}; "
             f"profile {profile.device})")
    print(describe(plan, config, title))
    if args.out:
        print(f"plan written to {plan.save(args.out)}")
    if args.png:
        print(f"rate match drawn to {draw_rate_match(plan, config, proxy, args.png)}")
    return 0
