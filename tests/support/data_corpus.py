"""Shared helpers of the tests/test_data_*.py files: a small demo corpus and loader runs."""

from __future__ import annotations

from pathlib import Path

from mindspeed_flow.data import FlowDataLoader
from mindspeed_flow.data.demo import make_demo_corpus

SAMPLES = 120


def demo_corpus(tmp_path_factory, samples: int = SAMPLES) -> Path:
    return make_demo_corpus(tmp_path_factory.mktemp("demo_corpus"), samples=samples, seed=7)


def epoch_ids(loader: FlowDataLoader) -> list[list[str]]:
    """The sample ids of every pack of one epoch, in order."""
    return [batch["sample_ids"] for batch in loader]
