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
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mindspeed-flow", allow_abbrev=False,
                                     description="mindspeed-flow: decoupled VLM training for MindSpeed-MM and Megatron")
    parser.add_argument("--version", action="version", version=f"mindspeed-flow {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return args.func(args, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
