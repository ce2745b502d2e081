"""``mindspeed-flow pool-clean``: remove what ``shm`` pools left in ``/dev/shm`` after their
processes were killed (a pool's own ``close()`` removes its files; a SIGKILLed process group
cannot).  Pools with a live participant are never touched."""

from __future__ import annotations

import argparse
from typing import Sequence


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "pool-clean", help="remove /dev/shm files of shm pools whose processes are all gone",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--prefix", default="", metavar="NAME",
                        help="only pools whose name starts with NAME (default: every shm pool)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    from mindspeed_flow.pool.shm import clean

    removed = clean(args.prefix, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for path in removed:
        print(f"{verb} {path}")
    print(f"pool-clean: {verb} {len(removed)} path(s)")
    return 0
