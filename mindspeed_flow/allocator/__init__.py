"""Heterogeneous Parallel Allocator (FlowTrain): separate parallel configs for the vision
encoder (producer) and the LLM backbone (consumer), sized so that production matches
consumption under a device budget.

:class:`Profile` holds measured throughput points; :class:`ProxyModel` predicts any config
from them (compute scaling, TP communication and efficiency loss, the pipeline bubble from
the schedule simulator, DP gradient reduction, memory); :func:`solve` picks one config per
module with a HiGHS MILP and returns an :class:`AllocationPlan` (named so apart from the schedule's
:class:`~mindspeed_flow.schedule.Plan` of per-rank programs).  See ``docs/allocator.md``.
"""

from .errors import AllocatorError, InfeasibleError
from .plan import AllocationPlan, BackboneConfig, EncoderConfig, Prediction
from .profile import Profile, ProfilePoint
from .proxy import ProxyModel
from .solve import solve
from .specs import AllocatorConfig, ClusterSpec, ModelSpec, ModuleSpec, Workload, load_config

__all__ = [
    "AllocationPlan",
    "AllocatorConfig",
    "AllocatorError",
    "BackboneConfig",
    "ClusterSpec",
    "EncoderConfig",
    "InfeasibleError",
    "ModelSpec",
    "ModuleSpec",
    "Prediction",
    "Profile",
    "ProfilePoint",
    "ProxyModel",
    "Workload",
    "load_config",
    "solve",
]
