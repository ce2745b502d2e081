"""The pool a job asked for: ``--flow-pool-backend NAME`` (or ``--flow-pool``, which takes
the default backend) on Megatron's command line or in ``MINDSPEED_FLOW_FLAGS``."""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from ..config import FlowConfig
from .base import Pool


def open_job_pool(args: argparse.Namespace, capacity_bytes: int, environ: Mapping[str, str] | None = None,
                  **options: Any) -> Pool:
    """Open the backend the job's flags select; refuse when the pool feature is off."""
    from . import open_pool

    config = FlowConfig.from_namespace(args, environ)
    if config.pool_backend is None:
        raise ValueError("the job did not ask for a pool: pass --flow-pool-backend NAME (or --flow-pool)")
    return open_pool(config.pool_backend, capacity_bytes=capacity_bytes, **options)
