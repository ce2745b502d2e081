"""``mindspeed-flow average-checkpoints OUT IN1 IN2 ... [--weights w1 w2 ...]``."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from .averaging import average_checkpoints
from .errors import AveragingError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "average-checkpoints", help="weighted average of checkpoints (Megatron torch format or HF safetensors)",
        description="Average models that share names, shapes and parallel layout (e.g. SFT runs at 2K/4K/8K "
                    "sequence length), one tensor at a time.  Weights are normalised to sum to 1.")
    parser.add_argument("out", help="output directory (created; must be empty)")
    parser.add_argument("inputs", nargs="+", metavar="IN", help="input checkpoint directories (at least two)")
    parser.add_argument("--weights", nargs="+", type=float, default=None, metavar="W",
                        help="one positive weight per input (default: equal)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    try:
        out = average_checkpoints(args.out, args.inputs, args.weights)
    except AveragingError as err:
        print(f"mindspeed-flow average-checkpoints: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out} (average of {len(args.inputs)} checkpoints)")
    return 0
