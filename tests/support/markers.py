"""Skip marks the tests share, each with the reason a reader needs to make the test run."""

from __future__ import annotations

import importlib.util

import pytest

requires_megatron_core = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is not installed (pip install 'mindspeed-flow[megatron]')",
)
