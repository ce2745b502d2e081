"""Applying the ``system`` feature when the plugin activates (before upstream, and so
``torch_npu``, is imported): the Ascend environment defaults, then the core binding."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from typing import MutableMapping

from .ascend_env import EnvSetting, apply_ascend_env
from .numa import Binding, apply_binding, binding_for_this_process, cuda_numa_node, local_ranks

log = logging.getLogger("mindspeed_flow")

_applied: tuple[list[EnvSetting], Binding] | None = None


def device_nodes(environ: MutableMapping[str, str]) -> list[int | None] | None:
    """Each local rank's CUDA device NUMA node (device index = local rank), else ``None``."""
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    _, world = local_ranks(environ)
    return [cuda_numa_node(r) for r in range(world)]


def ascend_env_report(environ: MutableMapping[str, str]) -> list[EnvSetting]:
    if importlib.util.find_spec("torch_npu") is None:
        return []
    if "torch_npu" in sys.modules:
        log.warning("mindspeed-flow system: torch_npu was imported before the plugin activated; "
                    "the Ascend environment defaults may come too late for it")
    return apply_ascend_env(environ)


def apply_system_settings(environ: MutableMapping[str, str] | None = None) -> tuple[list[EnvSetting], Binding]:
    """Once per process: Ascend defaults (where torch_npu is installed) and the binding."""
    global _applied
    if _applied is None:
        environ = os.environ if environ is None else environ
        report = ascend_env_report(environ)
        for setting in report:
            log.info("mindspeed-flow system: %s", setting.describe())
        binding = binding_for_this_process(environ, device_nodes=device_nodes(environ))
        apply_binding(binding)
        _applied = (report, binding)
    return _applied
