"""The recipe flags: values that act under the ``recipes`` feature.

Every value is off by default, so ``--use-flowtrain`` (which turns the feature on) changes
no number of a run that did not give one; giving a value turns the feature on
(:class:`mindspeed_flow.config.RecipeOptions` holds them).  Every default is ``None``, "not
given", so that the same flag in ``MINDSPEED_FLOW_FLAGS`` is not hidden by a default the
command line's parse filled in; the recipe applies its own default.
"""

from __future__ import annotations

import argparse

from .module_lr import MODULE_PREFIXES, TRANSFORMERS_MODULE_PREFIXES


def add_recipe_arguments(group: argparse._ArgumentGroup) -> None:
    names = (f"pretrain_vlm.py: {', '.join(MODULE_PREFIXES)}; "
             f"pretrain_transformers.py: {', '.join(TRANSFORMERS_MODULE_PREFIXES)}")
    group.add_argument("--flow-module-lr", nargs="+", default=None, metavar="PREFIX=MULT",
                       help=f"learning-rate multiplier (>= 0) per parameter-name prefix ({names}); implies --flow-recipes")
    group.add_argument("--flow-module-lr-warmup", nargs="+", default=None, metavar="PREFIX=STEPS",
                       help="an own linear warm-up (steps) per prefix, on top of the schedule; implies --flow-recipes")
    group.add_argument("--flow-module-grad-clip", nargs="+", default=None, metavar="PREFIX=MAX_NORM",
                       help="clip each prefix's gradient norm before the global --clip-grad; implies --flow-recipes")
    group.add_argument("--flow-loss-weighting", nargs="+", default=None, metavar="PATTERN=TASK",
                       help="dynamic per-task loss weights (inverse moving average of each task's loss, mean 1); "
                            "a sample's task is the first glob PATTERN its source file (from sample_ids) matches; "
                            "implies --flow-recipes")
    group.add_argument("--flow-loss-weighting-beta", type=float, default=None, metavar="BETA",
                       help="momentum of the per-task loss moving averages, in [0, 1) (default 0.9)")
