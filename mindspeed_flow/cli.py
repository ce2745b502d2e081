"""The ``mindspeed-flow`` command.  Each subcommand lives in its own module, which adds
itself to the parser through ``register(subparsers)`` and sets ``func``."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from mindspeed_flow import __version__

SUBCOMMAND_MODULES = (
    "mindspeed_flow.doctor",
    "mindspeed_flow.schedule.cli",
    "mindspeed_flow.schedule.plan_cli",
    "mindspeed_flow.attention.conv_matmul_cli",
    "mindspeed_flow.allocator.cli",
    "mindspeed_flow.recipes.average_cli",
    "mindspeed_flow.train.cli",
    "mindspeed_flow.selftest",
    "mindspeed_flow.pool.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mindspeed-flow", allow_abbrev=False,
                                     description="mindspeed-flow: decoupled VLM training for MindSpeed-MM and Megatron")
    parser.add_argument("--version", action="version", version=f"mindspeed-flow {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


# ``plan dump|check`` work on schedule plans; ``plan CONFIG`` (anything else) is the
# allocator's ``allocate CONFIG``.
SCHEDULE_PLAN_ACTIONS = ("dump", "check")


def _route_plan(argv: list[str]) -> list[str]:
    if len(argv) > 1 and argv[0] == "plan" and argv[1] not in SCHEDULE_PLAN_ACTIONS \
            and not argv[1].startswith("-"):
        return ["allocate"] + argv[1:]
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    argv = _route_plan(list(sys.argv[1:] if argv is None else argv))
    args = build_parser().parse_args(argv)
    return args.func(args, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
