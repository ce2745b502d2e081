"""The plugin's configuration: its flags, the typed tree they resolve to, and the check of
upstream's parsed arguments against that tree.

- :mod:`.flags`: the flags, registered into upstream's parsers; ``MINDSPEED_FLOW_FLAGS``.
- :mod:`.options`: one dataclass per feature (schedule, pool, allocator, recipes, system).
- :mod:`.tree`: :class:`FlowConfig`, the features plus their options, and its resolution
  (command line over ``MINDSPEED_FLOW_FLAGS`` over defaults).
- :mod:`.check`: Megatron's namespace against the tree resolved at activation.

The tree is resolved once when the plugin activates and installed beside the patch registry
(:func:`mindspeed_flow.activation.flow_config` reads it).
"""

from .check import config_items, cross_check
from .flags import (
    ENV_VAR, FEATURE_NAMES, FEATURES, MASTER_DEST, MASTER_FLAG, FeatureSpec, add_flow_arguments, env_flags,
    flags_requested, parse_flow_flags,
)
from .options import (
    DEFAULT_POOL_BACKEND_RULE, POOL_BACKENDS, AllocatorOptions, PoolOptions, RecipeOptions, ScheduleOptions,
    SystemOptions, default_pool_backend, flag_dest,
)
from .tree import OPTIONS, PACKING_TURNS_ON_VARLEN, PACKING_WITHOUT_VARLEN, FlagError, FlowConfig, resolve

__all__ = [
    "DEFAULT_POOL_BACKEND_RULE", "ENV_VAR", "FEATURES", "FEATURE_NAMES", "MASTER_DEST", "MASTER_FLAG", "OPTIONS",
    "PACKING_TURNS_ON_VARLEN", "PACKING_WITHOUT_VARLEN", "POOL_BACKENDS", "AllocatorOptions", "FeatureSpec",
    "FlagError", "FlowConfig", "PoolOptions", "RecipeOptions", "ScheduleOptions", "SystemOptions",
    "add_flow_arguments", "config_items", "cross_check", "default_pool_backend", "env_flags", "flag_dest", "flags_requested",
    "parse_flow_flags", "resolve",
]
