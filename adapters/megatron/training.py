"""Megatron-LM's argument path (``megatron.training.arguments``), which the PyPI wheel lacks.

Megatron parses with unknown flags rejected, so the plugin's flags must be in its parser:
``parse_args`` is wrapped to chain :func:`mindspeed_flow.config.add_flow_arguments` after
the caller's ``extra_args_provider`` (MindSpeed-MM passes its own), and ``validate_args``
is wrapped to check the whole namespace against the config tree resolved at activation
(:func:`mindspeed_flow.activation.flow_config`), so that a contradiction, or a namespace that
disagrees with the tree, fails at start-up with the flags named, and to log what is on.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable

from mindspeed_flow.activation import flow_config, job_notes
from mindspeed_flow.adapters.megatron.decoupled_layout import describe_sizes
from mindspeed_flow.adapters.megatron import roles
from mindspeed_flow.config import add_flow_arguments

log = logging.getLogger(__name__)

Provider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


def with_flow_arguments(provider: Provider | None) -> Provider:
    """An ``extra_args_provider`` that runs ``provider`` first, then adds our flags."""

    def provider_with_flow(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        if provider is not None:
            parser = provider(parser)
        return add_flow_arguments(parser)

    return provider_with_flow


def parse_args_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> argparse.Namespace:
    """``parse_args(extra_args_provider=None, ignore_unknown_args=False)`` with our flags."""

    def bind(extra_args_provider=None, ignore_unknown_args=False):
        return extra_args_provider, ignore_unknown_args

    provider, ignore_unknown = bind(*args, **kwargs)
    return wrapped(with_flow_arguments(provider), ignore_unknown)


def validate_args_wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``validate_args(args, defaults={})``, then check the switches and say what is on."""
    result = wrapped(*args, **kwargs)
    namespace = args[0] if args else kwargs["args"]
    config = flow_config(namespace)
    if getattr(namespace, "rank", 0) == 0:
        log.info("mindspeed-flow: %s", config.describe())
        layout = roles.ROLES.layout
        decoupled = f"{describe_sizes(layout)}, {layout.world_size} ranks" if layout is not None else None
        for note in job_notes(config, decoupled):
            log.info("mindspeed-flow %s", note)
    return result
