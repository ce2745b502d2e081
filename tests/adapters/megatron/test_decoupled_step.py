"""The decoupled step's pure parts (adapters/megatron/decoupled_step.py); the step itself runs
in tests/upstream/test_real_job_decoupled.py."""

from __future__ import annotations

from mindspeed_flow.adapters.megatron.decoupled_step import CountingIterator


def test_an_encoder_replica_ends_its_step_at_the_slices_last_microbatch():
    """Replica 0 of 2 forwards microbatches 0 and 2 of 4: the runtime pulls items 0-2; the
    step's fourth is taken after it, so the next step starts at item 4."""
    data = CountingIterator(iter(range(8)))
    taken = [next(data) for _ in range(3)]
    data.skip_to(4)
    assert taken == [0, 1, 2] and data.taken == 4 and next(data) == 4
    data.skip_to(5)  # nothing left to skip
    assert next(data) == 5
