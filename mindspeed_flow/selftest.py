"""``mindspeed-flow selftest``: the plugin's piecewise checks, run for real on this machine.

The checks (patch table, megatron-core's 1F1B at PP=2 against one process, packing and
dispatch, fused attention inside megatron-core, simulated schedules) are the package's; they
are run by the source checkout's ``scripts/selftest.py``, because they read the checkout's
workload and simulation configs (``configs/``), which a wheel does not ship (nothing of
``tests/`` is used).  So this subcommand runs that script when the package is an editable
install of a checkout, and otherwise says that the self-test needs one.  ``mindspeed-flow train`` is the main job;
this is the quick look at each piece.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import mindspeed_flow

SCRIPT = Path("scripts") / "selftest.py"
CONFIGS = Path("configs")


def add_selftest_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options shared by this subcommand and ``scripts/selftest.py`` (one definition)."""
    parser.add_argument("--only", action="append", default=[], metavar="SECTION",
                        help="run only this section (repeatable); --list names them")
    parser.add_argument("--list", action="store_true", help="list the sections and exit")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="folder for the charts (default: outputs/selftest in the checkout)")
    return parser


def checkout_root(package_dir: Path | None = None) -> Path | None:
    """The source checkout the package is imported from, or None for an installed copy.

    An editable install imports ``mindspeed_flow`` from ``<checkout>/mindspeed_flow``; the
    checkout is recognised by the self-test script and the configs it reads beside it.
    """
    root = (package_dir or Path(mindspeed_flow.__file__).resolve().parent).parent
    return root if (root / SCRIPT).is_file() and (root / CONFIGS).is_dir() else None


def selftest_command(root: Path, argv: Sequence[str]) -> list[str]:
    """The command that runs the checkout's script with this interpreter and these options."""
    return [sys.executable, str(root / SCRIPT), *argv]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "selftest", help="run the piecewise checks (needs a source checkout)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    add_selftest_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    root = checkout_root()
    if root is None:
        package = Path(mindspeed_flow.__file__).resolve().parent
        print(f"mindspeed-flow selftest: the self-test needs a source checkout: mindspeed_flow is imported "
              f"from {package}, which has no {SCRIPT} and {CONFIGS}/ beside it. Clone the repository and "
              f"install it in editable mode (pip install -e .), or run its scripts/selftest.py.",
              file=sys.stderr)
        return 2
    return subprocess.run(selftest_command(root, argv)).returncode
