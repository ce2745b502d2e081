"""MindSpeed's feature manager: mindspeed-flow as one ``MindSpeedFeature``.

When MindSpeed is present it owns argument registration (``register_features_args``) and
patch timing (``register_patches``).  Appending our feature to the list that
``MindSpeedFeaturesManager.set_features_list`` installs puts our flags into MindSpeed's
early parser and Megatron's parser, and lets MindSpeed tell us when to apply patches.
MindSpeed imports ``torch_npu``, so nothing here is imported before MindSpeed is.  The
feature reads the config tree resolved at activation, checked against MindSpeed's ``args``
(:func:`mindspeed_flow.activation.flow_config`).
"""

from __future__ import annotations

import argparse
import functools
import logging
from typing import Any, Callable

from mindspeed_flow.activation import current_registry, enable_features, flow_config
from mindspeed_flow.config import add_flow_arguments

log = logging.getLogger(__name__)

FEATURE_NAME = "use-flowtrain"
ARGS = "MindSpeed's arguments"


@functools.lru_cache(maxsize=1)
def flowtrain_feature_class() -> type:
    """The ``MindSpeedFeature`` subclass, built on first use from the installed MindSpeed."""
    from mindspeed.features_manager.feature import MindSpeedFeature

    class FlowTrainFeature(MindSpeedFeature):
        """Registers the mindspeed-flow flags and enables the features they select."""

        def __init__(self) -> None:
            super().__init__(FEATURE_NAME, optimization_level=0)

        def is_need_apply(self, args: argparse.Namespace) -> bool:
            return bool(flow_config(args, ARGS).features)

        def register_args(self, parser: argparse.ArgumentParser) -> None:
            add_flow_arguments(parser)

        def validate_args(self, args: argparse.Namespace) -> None:
            flow_config(args, ARGS)

        def register_patches(self, patch_manager: Any, args: argparse.Namespace) -> None:
            enable_features(flow_config(args, ARGS).features)

    return FlowTrainFeature


def set_features_list_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``MindSpeedFeaturesManager.set_features_list(features_list)`` plus our feature, once."""

    def bind(features_list):
        return features_list

    features = list(bind(*args, **kwargs))
    feature_class = flowtrain_feature_class()
    if not any(isinstance(f, feature_class) for f in features):
        features.append(feature_class())
    return wrapped(features)


def apply_patches_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``MindSpeedPatchesManager.apply_patches()``, then re-apply what it replaced of ours.

    MindSpeed (and MindSpeed-MM, through the same manager) sets patched attributes
    directly; a MindSpeed replacement of a target we had wrapped would drop our wrapper.
    """
    result = wrapped(*args, **kwargs)
    registry = current_registry()
    if registry is not None:
        for target in registry.refresh():
            log.info("mindspeed-flow: re-applied %s over MindSpeed's patch", target)
    return result
