"""``mindspeed-flow doctor``: is every patch target where the patch expects it?

Against the installed upstream it imports each target module (so the answer is what a job
would meet); with ``--src DIR`` it reads a source checkout with :mod:`ast` and imports
nothing, which is how MindSpeed and MindSpeed-MM (not pip-installable, NPU-only imports)
are checked from a clone; given a MindSpeed-MM tree it also checks the plugin's launch
example (``scripts/mindspeed_mm/``, or ``--launch-script``) against the flags the trees
declare (:mod:`mindspeed_flow.patching.launch_check`).  Given plugin flags it first
activates the plugin, so the table shows which targets were actually swapped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Mapping, Sequence

from mindspeed_flow.config import add_flow_arguments, flags_requested
from mindspeed_flow.patching import Patch, PatchStatus
from mindspeed_flow.patching.check import check_installed, check_source
from mindspeed_flow.patching.launch_check import report_launch_scripts
from mindspeed_flow.patching.status import APPLIED, SKIPPED, format_table


def source_version(root: Path) -> str:
    """``"source <dir> @ <commit>"``: a checkout has no package metadata to read."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"source {root}" + (f" @ {commit}" if commit else "")


def check_sources(patches: Sequence[Patch], roots: Sequence[Path]) -> list[PatchStatus]:
    """Each patch against the first checkout that holds its module."""
    versions = {root: source_version(root) for root in roots}  # one git call per checkout
    rows = []
    for patch in patches:
        results = [check_source(patch, [root], versions[root]) for root in roots]
        rows.append(next((r for r in results if r.status != "not installed"), results[0]))
    return rows


def check_installed_patches(patches: Sequence[Patch]) -> list[PatchStatus]:
    """Each patch against the installed upstream; the active registry's word wins."""
    from mindspeed_flow.activation import current_registry

    rows = [check_installed(p) for p in patches]
    registry = current_registry()
    if registry is None:
        return rows
    live = {(r.feature, r.target): r for r in registry.report() if r.status in (APPLIED, SKIPPED)}
    return [live.get((r.feature, r.target), r) for r in rows]


def pool_report() -> str:
    """One line per pool backend (``--flow-pool-backend``): can it run here, or why not."""
    from mindspeed_flow.pool.availability import backend_status

    lines = ["pool backends (--flow-pool-backend):"]
    for backend, reason in backend_status().items():
        lines.append(f"  {backend:<10} " + ("can run here" if reason is None else f"cannot run here: {reason}"))
    return "\n".join(lines)


def pool_rows(args: argparse.Namespace) -> list[dict]:
    """``doctor --json``'s rows for the pool backends (feature ``pool``): whether each can
    run on this machine; none under ``--src`` (a checkout says nothing about this machine)
    or when ``--feature`` names other features only."""
    from mindspeed_flow.pool.availability import POOL_FEATURE, backend_rows

    return [] if args.src or (args.feature and POOL_FEATURE not in args.feature) else backend_rows()


def binding_report(environ: Mapping[str, str] | None = None, **device: Any) -> str:
    """The core binding ``--flow-system`` would apply to this process (LOCAL_RANK / LOCAL_WORLD_SIZE).

    ``device``: :func:`~mindspeed_flow.system.apply.planned_binding`'s device kind, sysfs roots
    and bus-id queries (detected / the real ones unless given).
    """
    from mindspeed_flow.system.apply import device_kind, planned_binding

    if "kind" not in device:
        device["kind"] = device_kind()
    binding = planned_binding(dict(os.environ if environ is None else environ), **device)
    return f"core binding (--flow-system) it would apply: {binding.describe()}"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor", help="check every patch target against the installed upstream or a source checkout",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--src", action="append", type=Path, default=[], metavar="DIR",
                        help="upstream source checkout to read instead of importing (repeatable)")
    parser.add_argument("--feature", action="append", default=[], metavar="NAME",
                        help="only this feature's patches (repeatable)")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    parser.add_argument("--launch-script", action="append", type=Path, default=[], metavar="SH",
                        help="with --src: check this MindSpeed-MM launch script's flags and files (repeatable; "
                             "default: the plugin's examples in scripts/mindspeed_mm/; findings go to stderr "
                             "under --json)")
    add_flow_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    from mindspeed_flow.patches import activate, all_patches

    if args.launch_script and not args.src:
        raise SystemExit("doctor: --launch-script needs --src (the MindSpeed-MM and MindSpeed checkouts)")
    patches = [p for p in all_patches() if not args.feature or p.feature in args.feature]
    if args.src:
        missing = [str(d) for d in args.src if not d.is_dir()]
        if missing:
            raise SystemExit(f"doctor: --src {', '.join(missing)}: no such directory")
        rows = check_sources(patches, args.src)
    else:
        if flags_requested(argv):
            activate(argv)
        rows = check_installed_patches(patches)
    if args.json:
        print(json.dumps([asdict(r) | {"failure": r.is_failure} for r in rows] + pool_rows(args), indent=1))
    else:
        print(format_table(rows))
        failures = sum(r.is_failure for r in rows)
        print(f"\n{len(rows)} patch(es), {failures} required target(s) missing or changed")
        print("\n" + pool_report())
        print("\n" + binding_report())
    launch_failed = report_launch_scripts(args.src, args.launch_script, out=sys.stderr if args.json else sys.stdout)
    return 1 if any(r.is_failure for r in rows) or launch_failed else 0
