"""Run an upstream training script with the plugin active.

    python -m mindspeed_flow.launch pretrain_vlm.py --use-flowtrain ARGS...
    torchrun --nproc-per-node 8 -m mindspeed_flow.launch pretrain_vlm.py ARGS...
    python -m mindspeed_flow.launch -m some.module ARGS...

The plugin is activated before the script runs, so every patch waits for its upstream
module and is in place before upstream parses arguments.  Which features are on follows
the flags in ARGS and ``MINDSPEED_FLOW_FLAGS``, exactly as on the zero-edit path; with none
of them, only the flags' registration is active.

This module is also the zero-edit path's entry: the ``mindspeed_flow_autoload.pth`` file
installed next to the package calls :func:`autoload` when a cheap scan of ``sys.argv`` and
the environment finds a plugin flag, and imports nothing of the plugin otherwise.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Sequence

USAGE = "usage: python -m mindspeed_flow.launch (SCRIPT | -m MODULE) [ARGS...]"


REFUSED = "mindspeed-flow: refusing to start: "
REFUSED_EXIT_CODE = 2


def refuse(error: Exception) -> str:
    """The one line a refused start-up prints (flags that contradict each other)."""
    return f"{REFUSED}{error}"


def start(argv: Sequence[str]) -> bool:
    """The plugin's activation, as the ``.pth`` hook and the launcher run it: torch's stores
    kept on loopback first (torchrun's agent runs the hook too, before its store), then the
    config tree resolved from ``argv`` over ``MINDSPEED_FLOW_FLAGS`` and installed with the
    registry.  Flags the tree or the activation (features the script cannot run) refuses (:class:`~mindspeed_flow.config.FlagError`) print the
    one refusal line; the caller ends the process (``False``)."""
    from mindspeed_flow.config import FlagError, FlowConfig
    from mindspeed_flow.patches import activate

    keep_stores_on_loopback()
    try:
        activate(config=FlowConfig.from_argv(argv))
    except FlagError as error:
        print(refuse(error), file=sys.stderr, flush=True)
        return False
    return True


def autoload() -> None:
    """Activate the plugin if the command line or environment asks for it (the .pth hook).

    Refused flags end the process here with exit code 2 and one line naming them: ``site``
    would print an exception raised in a ``.pth`` line and go on, and the job would start
    without the plugin.
    """
    from mindspeed_flow.config import flags_requested

    if flags_requested(sys.argv[1:]) and not start(sys.argv[1:]):
        sys.stdout.flush()
        os._exit(REFUSED_EXIT_CODE)


def keep_stores_on_loopback() -> None:
    """torch's own rendezvous stores (``env://`` / ``tcp://`` in rank 0, torchrun's agent)
    listen only on their host when it is a loopback address
    (:func:`mindspeed_flow.loopback.keep_stores_on_loopback`; torch binds them on every
    interface).  Part of the plugin's activation, so it runs first, in every process."""
    from mindspeed_flow.loopback import keep_stores_on_loopback as install

    install()


def put_script_folder_first(script: str) -> None:
    """``sys.path[0]`` as ``python SCRIPT`` sets it: the script's folder (symlinks resolved)
    instead of the working directory that ``python -m`` put there.  MindSpeed-MM keeps its
    ``megatron/`` copy beside ``pretrain_vlm.py``, so this decides which Megatron is imported."""
    folder = os.path.dirname(os.path.realpath(script))
    if sys.path and sys.path[0] in ("", os.getcwd()):
        sys.path[0] = folder
    else:
        sys.path.insert(0, folder)


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    run_module = argv[0] == "-m"
    if run_module and len(argv) < 2:
        raise SystemExit(USAGE)
    target, script_args = (argv[1], argv[2:]) if run_module else (argv[0], argv[1:])
    if not run_module:
        put_script_folder_first(target)

    if not start(script_args):  # after the path is set: upstream beside the script is checked now
        raise SystemExit(REFUSED_EXIT_CODE)
    sys.argv = [target, *script_args]
    if run_module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
