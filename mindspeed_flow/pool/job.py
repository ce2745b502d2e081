"""The pool a job asked for: ``--flow-pool-backend NAME`` (or ``--flow-pool``, which takes
the default backend) on Megatron's command line or in ``MINDSPEED_FLOW_FLAGS``, as the config
tree holds it (``pool.backend``)."""

from __future__ import annotations

import argparse
from typing import Any, Mapping

from ..activation import flow_config
from ..config import FlowConfig
from .base import Pool


def open_job_pool(args: argparse.Namespace, capacity_bytes: int, environ: Mapping[str, str] | None = None,
                  **options: Any) -> Pool:
    """Open the backend the job's config tree selects (``environ`` given: the tree resolved
    from ``args`` over that environment instead); refuse when the pool feature is off."""
    from . import open_pool

    config = flow_config(args) if environ is None else FlowConfig.from_namespace(args, environ)
    if config.pool_backend is None:
        raise ValueError("the job did not ask for a pool: pass --flow-pool-backend NAME (or --flow-pool)")
    return open_pool(config.pool_backend, capacity_bytes=capacity_bytes, **options)
