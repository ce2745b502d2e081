"""megatron-core's own ``_get_param_groups``, called with the installed version's signature.

0.12 takes ``(model_chunks, no_weight_decay_cond, scale_lr_cond, lr_mult, lr, min_lr,
decoupled_lr, decoupled_min_lr)``; 0.16 takes ``(model_chunks, config, config_overrides)``
and all-gathers the group keys, so it needs a process group (one process is enough).
The function is looked up on the module at call time, so a patched one is what runs.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A one-rank gloo group for the duration (none is made if one exists already)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def megatron_param_groups(model_chunks: list[torch.nn.Module], lr: float, min_lr: float) -> list[dict]:
    """Megatron's default groups (weight decay off for biases and 1-d parameters)."""
    import megatron.core.optimizer as opt_module

    if "config" in inspect.signature(opt_module._get_param_groups).parameters:  # megatron-core >= 0.14
        with single_process_group():
            return opt_module._get_param_groups(model_chunks, opt_module.OptimizerConfig(lr=lr, min_lr=min_lr), None)
    return opt_module._get_param_groups(model_chunks, None, None, 1.0, lr, min_lr, None, None)
