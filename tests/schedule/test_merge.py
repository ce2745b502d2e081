"""order.merge: the heap-based list schedule picks exactly what the per-pick scan picks
(so compose's programs are unchanged), without scanning every rank for every pick."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from schedule_merge_reference import scan_merge

from mindspeed_flow.schedule import (
    Decoupled,
    GPipe,
    Interleaved1F1B,
    Kind,
    OneFOneB,
    Region,
    ScheduleError,
    Transpose,
)
from mindspeed_flow.schedule.order import merge, streams
from mindspeed_flow.schedule.placement import Placement
from mindspeed_flow.schedule.zero_bubble import ZeroBubbleH1


def _inputs(regions, microbatches):
    placement = Placement(regions)
    paths = tuple(placement.path(m) for m in range(microbatches))
    return streams(placement, microbatches), paths


def _weighted(action, visit):
    """Nominal times unlike the unit default: regions and passes of different weight."""
    weight = {"vit": 0.7, "head": 0.3, "llm": 1.3}[action.region]
    return weight * visit.layers * (1.0 if action.kind is Kind.FORWARD else 2.1)


@settings(max_examples=120, deadline=None)
@given(
    encoder=st.sampled_from(["1f1b", "transpose", "decoupled", "head"]),
    backbone=st.sampled_from(["1f1b", "gpipe", "interleaved", "zb-h1"]),
    stages=st.integers(1, 5),
    ranks=st.integers(1, 3),
    window=st.sampled_from([None, 2, 4]),
    microbatches=st.integers(1, 12),
    trainable=st.tuples(st.booleans(), st.booleans()),
    weighted=st.booleans(),
)
def test_heap_merge_picks_what_the_scan_picks(encoder, backbone, stages, ranks, window, microbatches,
                                              trainable, weighted):
    if encoder == "1f1b" and backbone != "1f1b":
        encoder = "transpose"  # only equal non-interleaved orders join into one pipeline
    if backbone == "interleaved":
        microbatches *= stages
    llm = {"1f1b": OneFOneB(stages=stages), "gpipe": GPipe(stages=stages),
           "interleaved": Interleaved1F1B(stages=stages), "zb-h1": ZeroBubbleH1(stages=stages)}[backbone]
    if encoder == "head":
        regions = [Region("llm", 4 * stages, llm, trainable=trainable[1]),
                   Region("head", 1, Transpose(max_in_flight=window), trainable=trainable[0])]
    else:
        vit = {"1f1b": OneFOneB(stages=1), "transpose": Transpose(max_in_flight=window),
               "decoupled": Decoupled(ranks=ranks, max_in_flight=window)}[encoder]
        regions = [Region("vit", 3, vit, trainable=trainable[0]),
                   Region("llm", 4 * stages, llm, trainable=trainable[1])]
    duration = {"duration": _weighted} if weighted else {}
    plan_streams, paths = _inputs(regions, microbatches)
    try:
        expected = scan_merge(plan_streams, paths, **duration)
    except ScheduleError:  # a window too small to order: the heap merge must refuse it too
        try:
            merge(plan_streams, paths, **duration)
        except ScheduleError as error:
            assert "skeleton orders cannot be merged" in str(error)
            return
        raise AssertionError("the scan refused orders the heap merge accepted")
    assert merge(plan_streams, paths, **duration) == expected


class _CountingPaths(Sequence):
    """The microbatch paths, counting every read of one."""

    def __init__(self, paths):
        self.paths, self.reads = paths, 0

    def __getitem__(self, m):
        self.reads += 1
        return self.paths[m]

    def __len__(self):
        return len(self.paths)


def test_merge_reads_each_path_a_bounded_number_of_times_per_pick():
    # The scan re-examined the next step of every rank before every pick (reading the
    # path of each waiting backward): O(stages) reads per pick, O(p^2 m) in all.  The heap
    # merge reads every path once up front and the picked step's visit once.
    stages, microbatches = 16, 32
    plan_streams, paths = _inputs([Region("llm", stages, OneFOneB(stages=stages))], microbatches)
    picks = 2 * stages * microbatches
    counted = _CountingPaths(paths)
    merge(plan_streams, counted)
    assert counted.reads <= 3 * (len(paths) + 1) + picks
    scanned = _CountingPaths(paths)
    scan_merge(plan_streams, scanned)
    assert scanned.reads > 4 * picks  # the count tells the two algorithms apart
