"""The Ascend environment MindSpeed-MM's launch scripts export by hand, as defaults.

Values are the most common ones across MindSpeed-MM 57069cd's ``examples/*/*.sh``.  They
must be in the environment before ``torch_npu`` is imported (it reads them at import and
device init), so :func:`apply_ascend_env` runs when the plugin activates.  A variable the
user already set is never overridden; the report says which were applied and which kept.
None of them changes what a run computes: they select task-queue, CPU-affinity,
allocator, logging and timeout behaviour.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import MutableMapping

ASCEND_DEFAULTS: tuple[tuple[str, str, str], ...] = (
    ("TASK_QUEUE_ENABLE", "2", "level-2 task queue: operator dispatch pipelined on the host"),
    ("CPU_AFFINITY_CONF", "1", "bind torch_npu's host threads to cores"),
    ("PYTORCH_NPU_ALLOC_CONF", "expandable_segments:True", "fewer fragmented device blocks"),
    ("COMBINED_ENABLE", "1", "fuse non-contiguous copies"),
    ("ACLNN_CACHE_LIMIT", "100000", "aclnn operator cache entries"),
    ("HCCL_CONNECT_TIMEOUT", "1200", "seconds HCCL waits for peers at start-up"),
    ("ASCEND_LAUNCH_BLOCKING", "0", "asynchronous kernel launch"),
    ("NPU_ASD_ENABLE", "0", "silent-data-corruption detection off"),
    ("ASCEND_GLOBAL_LOG_LEVEL", "3", "CANN logs errors only"),
    ("ASCEND_SLOG_PRINT_TO_STDOUT", "0", "CANN logs to files, not stdout"),
)


# The defaults this plugin set, as the environment carries them to child processes: torchrun's
# own process activates the plugin too (its command line holds the flags), so its workers find
# the variables set and must not report them as the user's.
SET_BY_PLUGIN = "MINDSPEED_FLOW_ASCEND_ENV_SET"


@dataclass(frozen=True)
class EnvSetting:
    name: str
    value: str
    applied: bool  # False: the value was already there
    inherited: bool = False  # already there because the plugin set it in a parent process

    def describe(self) -> str:
        how = "set" if self.applied else "set by the plugin in the launching process" if self.inherited \
            else "kept user value"
        return f"{self.name}={self.value} ({how})"


def apply_ascend_env(environ: MutableMapping[str, str] | None = None) -> list[EnvSetting]:
    """Set each default the environment lacks; returns every variable's outcome."""
    environ = os.environ if environ is None else environ
    ours = {n for n in environ.get(SET_BY_PLUGIN, "").split(",") if n}
    report = []
    for name, value, _ in ASCEND_DEFAULTS:
        if name in environ:
            report.append(EnvSetting(name, environ[name], applied=False,
                                     inherited=name in ours and environ[name] == value))
        else:
            environ[name] = value
            ours.add(name)
            report.append(EnvSetting(name, value, applied=True))
    if ours:
        environ[SET_BY_PLUGIN] = ",".join(sorted(ours))
    return report
