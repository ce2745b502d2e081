"""Packing: offline BFD/FFD, online best fit, overlong and zero-length rules."""

from __future__ import annotations

from collections import Counter, defaultdict, deque

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from mindspeed_flow.packing import BestFitPacker, pack
from mindspeed_flow.packing.bfd import best_fit_decreasing
from mindspeed_flow.packing.ffd import first_fit_decreasing
from mindspeed_flow.packing.segment_tree import CapacityTree

FAST = settings(max_examples=60, deadline=None)


def reference_fit(lengths: list[int], capacity: int, best: bool) -> list[int]:
    """Item-by-item BFD (best=True) or FFD in decreasing order; bin of each sorted item.
    BFD ties go to the bin that reached that remaining space first (FIFO)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    room: list[int] = []
    queues: dict[int, deque[int]] = defaultdict(deque)
    out = []
    for i in order:
        size = lengths[i]
        if best:
            fits = [r for r, q in queues.items() if q and r >= size]
            b = queues[min(fits)].popleft() if fits else None
        else:
            b = next((k for k, r in enumerate(room) if r >= size), None)
        if b is None:
            b = len(room)
            room.append(capacity)
        room[b] -= size
        if best and room[b]:
            queues[room[b]].append(b)
        out.append(b)
    return out


def lengths_and_capacity(max_len: int = 60, max_items: int = 60):
    return st.integers(1, max_len).flatmap(
        lambda c: st.tuples(st.lists(st.integers(1, c), max_size=max_items), st.just(c))
    )


def chunk_lengths(length: int, capacity: int, policy: str) -> list[int]:
    """What the docs say an item becomes under each overlong policy."""
    if length == 0 or (length > capacity and policy == "drop"):
        return []
    if length <= capacity:
        return [length]
    if policy == "truncate":
        return [capacity]
    return [capacity] * (length // capacity) + ([length % capacity] if length % capacity else [])


def loads(packs, lengths):
    return [sum(lengths[i] for i in p) for p in packs]


# --- segment tree -----------------------------------------------------------------


@FAST
@given(st.integers(1, 9000), st.lists(st.tuples(st.booleans(), st.floats(0, 1), st.floats(0, 1)), max_size=80))
def test_capacity_tree_successor_matches_a_set(capacity, ops):
    tree, present = CapacityTree(capacity), set()
    for insert, where, query in ops:
        value = round(where * capacity)
        (tree.add if insert else tree.remove)(value)
        (present.add if insert else present.discard)(value)
        q = round(query * capacity)
        assert tree.successor(q) == min((v for v in present if v >= q), default=-1)
        assert (value in tree) == (value in present)


# --- offline ----------------------------------------------------------------------


@FAST
@given(lengths_and_capacity())
def test_batched_bfd_and_ffd_equal_item_by_item_loops(case):
    lengths, capacity = case
    arr = np.array(lengths, dtype=np.int64)
    for fn, best in ((best_fit_decreasing, True), (first_fit_decreasing, False)):
        order, bins = fn(arr, capacity)
        assert order.tolist() == sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        assert bins.tolist() == reference_fit(lengths, capacity, best)


def test_heavy_tail_bfd_and_ffd_equal_item_by_item_loops_across_blocks():
    """Heavy-tailed lengths (nearly every value distinct, many items above C/2, which the
    packers place all at once) over more than one 1024-bin FFD block."""
    rng = np.random.default_rng(3)
    capacity = 1500
    lengths = np.minimum(np.round(300 * np.exp(1.3 * rng.standard_normal(3600))).astype(np.int64) + 1, capacity)
    assert len(np.unique(lengths)) > 600 and (2 * lengths > capacity).sum() > 150
    for fn, best in ((best_fit_decreasing, True), (first_fit_decreasing, False)):
        order, bins = fn(lengths, capacity)
        assert bins.max() + 1 > 1024
        assert bins.tolist() == reference_fit(lengths.tolist(), capacity, best)


@FAST
@given(lengths_and_capacity())
def test_pack_places_every_item_once_within_capacity_and_beats_ffd(case):
    lengths, capacity = case
    packs = pack(lengths, capacity)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(0 < load <= capacity for load in loads(packs, lengths))
    ffd_bins = len(set(reference_fit(lengths, capacity, best=False)))
    assert packs.stats.lower_bound <= len(packs) <= ffd_bins
    assert len(packs) <= len(set(reference_fit(lengths, capacity, best=True)))
    assert packs.stats.packs == len(packs) and packs.stats.tokens == sum(lengths)


def test_pack_keeps_ffd_where_ffd_beats_bfd():
    lengths = [24, 20, 18, 17, 11, 9, 7, 5, 4, 4, 3, 2]
    assert len(set(reference_fit(lengths, 25, best=True))) == 6
    assert len(pack(lengths, 25)) == 5


def test_pack_is_deterministic_and_orders_packs_by_opening():
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 500, 5000)
    first, second = pack(lengths, 1024), pack(lengths.tolist(), 1024)
    assert first == second
    # Items inside a pack are in placement order: longest first.
    assert all(lengths[p].tolist() == sorted(lengths[p].tolist(), reverse=True) for p in map(np.array, first))
    # Packs in opening order: a decreasing packer opens a pack for an item no earlier pack
    # could take, so the packs' first items never grow.
    heads = [lengths[p[0]] for p in first]
    assert heads == sorted(heads, reverse=True)


def test_pack_empty_input():
    packs = pack([], 8)
    assert packs == [] and packs.stats.packs == 0 and packs.stats.fill == 1.0


# --- overlong and zero-length -----------------------------------------------------


def test_overlong_error_names_item_and_length():
    with pytest.raises(ValueError, match=r"item 2 has length 11 > capacity 10"):
        pack([3, 4, 11], 10)
    packer = BestFitPacker(10)
    with pytest.raises(ValueError, match=r"item 'doc-7' has length 25 > capacity 10"):
        packer.add("doc-7", 25)
    assert packer.stats.items == 0 and len(packer) == 0


def test_negative_length_and_bad_policy_are_errors():
    with pytest.raises(ValueError, match=r"item 1 has negative length -3"):
        pack([2, -3], 10, overlong="drop")
    with pytest.raises(ValueError, match="overlong policy"):
        pack([2], 10, overlong="wrap")


@FAST
@given(lengths_and_capacity(max_len=40), st.lists(st.integers(0, 200), max_size=8), st.sampled_from(["truncate", "split", "drop"]))
def test_overlong_policies_and_zero_length_rule(case, extra, policy):
    lengths, capacity = case
    lengths = lengths + extra  # adds overlong and zero-length items
    offline = pack(lengths, capacity, overlong=policy)
    online = BestFitPacker(capacity, window=4, overlong=policy)
    online_packs = [p for i, l in enumerate(lengths) for p in online.add(i, l)] + online.flush()
    for packs, stats in ((offline, offline.stats), (online_packs, online.stats)):
        seen = Counter(i for p in packs for i in p)
        over = [i for i, l in enumerate(lengths) if l > capacity]
        zero = [i for i, l in enumerate(lengths) if l == 0]
        assert stats.zero_length == len(zero) and not any(seen[i] for i in zero)
        for i, l in enumerate(lengths):
            if 0 < l <= capacity:
                assert seen[i] == 1
        if policy == "truncate":
            assert all(seen[i] == 1 for i in over) and stats.truncated == len(over)
            assert stats.truncated_tokens == sum(lengths[i] - capacity for i in over)
        elif policy == "split":
            assert all(seen[i] == -(-lengths[i] // capacity) for i in over)
            assert stats.split == len(over) and stats.split_chunks == sum(seen[i] for i in over)
        else:
            assert not any(seen[i] for i in over) and stats.dropped == len(over)
            assert stats.dropped_tokens == sum(lengths[i] for i in over)
        # Occurrences of an item in pack order are its chunks in token order: no pack over C.
        chunks = {i: iter(chunk_lengths(l, capacity, policy)) for i, l in enumerate(lengths)}
        assert all(0 < sum(next(chunks[i]) for i in p) <= capacity for p in packs)
        assert all(next(rest, None) is None for rest in chunks.values())
        placed = {"truncate": capacity, "split": None, "drop": 0}[policy]
        expected_tokens = sum(l if l <= capacity else (l if placed is None else placed) for l in lengths)
        assert stats.tokens == expected_tokens
        assert stats.items == len(lengths) and stats.packs == len(packs)


@FAST
@given(lengths_and_capacity(max_len=40), st.lists(st.integers(0, 200), min_size=1, max_size=8))
def test_overlong_error_names_the_first_overlong_item(case, extra):
    lengths, capacity = case
    lengths = lengths + extra
    over = [i for i, l in enumerate(lengths) if l > capacity]
    assume(over)
    first = over[0]
    message = rf"item {first} has length {lengths[first]} > capacity {capacity}"
    with pytest.raises(ValueError, match=message):
        pack(lengths, capacity)
    packer = BestFitPacker(capacity, window=3)
    with pytest.raises(ValueError, match=message):
        for i, l in enumerate(lengths):
            packer.add(i, l)
    assert packer.stats.items == first  # the refused item is not counted


def test_split_chunks_appear_in_token_order():
    # Item 0 = 25 tokens at C=10: chunks 10, 10, 5; the 5 shares a pack with item 1.
    packs = pack([25, 5], 10, overlong="split")
    assert packs == [[0], [0], [0, 1]]
    packer = BestFitPacker(10, overlong="split")
    assert packer.add(0, 25) == [[0], [0]]
    assert packer.add(1, 5) == [[0, 1]]


def test_stats_summary_reports_every_outcome(caplog):
    packs = pack([0, 30, 4], 10, overlong="truncate")
    assert packs.stats.zero_length == 1 and packs.stats.truncated == 1
    assert "truncated 1 (20 tokens)" in caplog.text and "zero-length 1" in caplog.text


# --- online -----------------------------------------------------------------------


@FAST
@given(lengths_and_capacity(), st.integers(1, 6))
def test_online_places_every_item_once_within_capacity_and_window(case, window):
    lengths, capacity = case
    packer = BestFitPacker(capacity, window=window)
    packs = []
    for i, l in enumerate(lengths):
        packs += packer.add(i, l)
        assert len(packer) <= window
    packs += packer.flush()
    assert len(packer) == 0
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(load <= capacity for load in loads(packs, lengths))
    stats = packer.stats
    assert stats.closed_full + stats.closed_window + stats.closed_flush == len(packs) == stats.packs


def reference_online(lengths: list[int], capacity: int, window: int):
    """The documented rule, item by item over a plain list of open packs: best fit; ties
    and the window victim (the fullest pack) by who reached that remaining space first;
    a full pack closes; ``flush`` in opening order.  Returns (closed per add, flushed)."""
    open_packs: list[dict] = []
    per_add = []
    for i, l in enumerate(lengths):
        closed = []
        fits = [p for p in open_packs if p["room"] >= l]
        if fits:
            target = min(fits, key=lambda p: (p["room"], p["since"]))
        else:
            if len(open_packs) >= window and l < capacity:
                victim = min(open_packs, key=lambda p: (p["room"], p["since"]))
                open_packs.remove(victim)
                closed.append(victim["items"])
            target = {"room": capacity, "items": [], "opened": i}
            open_packs.append(target)
        target["items"].append(i)
        target["room"] -= l
        target["since"] = i
        if not target["room"]:
            open_packs.remove(target)
            closed.append(target["items"])
        per_add.append(closed)
    return per_add, [p["items"] for p in sorted(open_packs, key=lambda p: p["opened"])]


@FAST
@given(lengths_and_capacity(max_len=30), st.integers(1, 5))
def test_online_follows_the_documented_rule(case, window):
    lengths, capacity = case
    packer = BestFitPacker(capacity, window=window)
    per_add = [packer.add(i, l) for i, l in enumerate(lengths)]
    assert (per_add, packer.flush()) == reference_online(lengths, capacity, window)


def test_online_ties_follow_fifo_not_opening_order():
    # a opens pack A (room 7), b opens B (room 2); c takes B to room 1, then d takes A to
    # room 1.  B reached room 1 first, so B is the window's victim although A is older.
    packer = BestFitPacker(10, window=2)
    assert [packer.add(i, l) for i, l in zip("abcd", [3, 8, 1, 6])] == [[], [], [], []]
    assert packer.add("e", 9) == [["b", "c"]]
    assert packer.flush() == [["a", "d"], ["e"]]


def test_online_best_fit_and_window_closing_rule():
    packer = BestFitPacker(10, window=2)
    assert packer.add("a", 6) == [] and packer.add("b", 7) == []  # two open packs: rooms 4, 3
    assert packer.add("c", 3) == [["b", "c"]]  # best fit is room 3 (not 4): full, closes
    assert packer.add("d", 1) == []  # rooms: a=3
    assert packer.add("e", 8) == []  # new pack (window 2 not exceeded); rooms a=3, e=2
    # 9 fits nowhere and the window is full: the fullest pack (e, room 2) closes.
    assert packer.add("f", 9) == [["e"]]
    assert packer.stats.closed_window == 1
    assert packer.flush() == [["a", "d"], ["f"]]  # oldest first


def test_online_ties_go_to_the_oldest_pack_and_full_items_skip_the_window():
    packer = BestFitPacker(10, window=2)
    packer.add(0, 5)
    packer.add(1, 6)
    packer.add(2, 5)  # closes pack 0 (full)
    assert packer.add(3, 10) == [[3]]  # exactly capacity: closes alone, nothing evicted
    assert packer.stats.closed_window == 0 and len(packer) == 1


def test_online_is_deterministic():
    rng = np.random.default_rng(5)
    lengths = rng.integers(1, 300, 3000).tolist()

    def run():
        packer = BestFitPacker(512, window=16)
        return [p for i, l in enumerate(lengths) for p in packer.add(i, l)] + packer.flush()

    assert run() == run()


def test_bad_arguments():
    for kwargs in ({"capacity": 0}, {"capacity": 8, "window": 0}, {"capacity": 8, "overlong": "x"}):
        with pytest.raises(ValueError):
            BestFitPacker(**kwargs)
    with pytest.raises(ValueError):
        pack([1], 0)


# ---------------------------------------------------------------- lengths the loader holds


LOADER_LENGTHS = [5000, 3000, 100, 8192, 2500, 700]


def online_packs(lengths, capacity=8192) -> list[list]:
    packer = BestFitPacker(capacity, window=2)
    packs = [p for i, length in enumerate(lengths) for p in packer.add(i, length)]
    return packs + packer.flush()


@pytest.mark.parametrize("convert", [np.array, lambda xs: np.array(xs, dtype=np.int32),
                                     lambda xs: [torch.tensor(x) for x in xs], torch.tensor],
                         ids=["numpy-int64", "numpy-int32", "0-d-tensors", "tensor"])
def test_numpy_and_tensor_integers_pack_like_ints(convert):
    """The loader's lengths come from numpy arrays and tensors (review finding 1)."""
    expected_online = online_packs(LOADER_LENGTHS)
    assert expected_online == [[3], [0, 1, 2], [4, 5]]
    assert online_packs(list(convert(LOADER_LENGTHS))) == expected_online
    assert online_packs(LOADER_LENGTHS, np.int64(8192)) == expected_online
    expected = pack(LOADER_LENGTHS, 8192)
    assert pack(convert(LOADER_LENGTHS), 8192) == expected
    assert pack(LOADER_LENGTHS, np.int64(8192)) == pack(LOADER_LENGTHS, torch.tensor(8192)) == expected


def test_capacity_tree_takes_numpy_integers():
    tree = CapacityTree(np.int64(8192))
    for value in np.array([300, 5000, 70]):
        tree.add(value)
    assert tree.successor(np.int64(301)) == 5000 and np.int32(70) in tree
    tree.remove(np.int64(5000))
    assert tree.successor(torch.tensor(301)) == -1 and type(tree.successor(np.int64(1))) is int


def test_pack_takes_any_iterable_of_integers():
    expected = pack([5, 3, 2, 6], 8)
    assert pack((x for x in [5, 3, 2, 6]), 8) == expected  # a generator
    assert pack(iter(range(5, 1, -1)), 8) == pack([5, 4, 3, 2], 8)
    assert pack((5, np.int64(3), torch.tensor(2), 6), 8) == expected  # mixed integer kinds


@pytest.mark.parametrize("lengths, message", [
    ([2.7, 5.9], r"item 0 must be an integer .* got 2.7 of type float"),  # was: silently packed 2 and 5
    ([4, 3, 2.0], r"item 2 must be an integer .* got 2.0 of type float"),
    (np.array([4.0, 3.0]), r"item 0 must be an integer .* got 4.0"),
    (torch.tensor([1.5, 2.0]), r"item 0 must be an integer .* got 1.5"),
    ([4, True], r"item 1 must be an integer, got the boolean True"),
    ([4, None], r"item 1 must be an integer .* got None"),
    ([[1, 2], [3, 4]], r"flat: item 0 is the sequence \[1, 2\]"),  # was: flattened into 4 items
    (np.array([[1, 2], [3, 4]]), r"flat \(1-D\), got an array of shape \(2, 2\): item 0 is \[1, 2\]"),
    ([3, [2]], r"flat: item 1 is the sequence \[2\]"),
    ("35", "an iterable of integers, got str"),
    (7, "an iterable of integers, got int"),
])
def test_pack_refuses_non_integer_lengths_naming_the_first_bad_item(lengths, message):
    with pytest.raises((TypeError, ValueError), match=message):
        pack(lengths, 8)


def test_online_refuses_non_integer_lengths_and_stays_unchanged():
    packer = BestFitPacker(8)
    packer.add("a", np.int64(3))
    for bad in (2.5, np.float32(2.0), torch.tensor(2.5), True):
        with pytest.raises(TypeError, match="length of item 'b' must be an integer"):
            packer.add("b", bad)
    assert packer.stats.items == 1 and packer.flush() == [["a"]]
    with pytest.raises(TypeError, match="capacity must be an integer"):
        BestFitPacker(8192.0)
    with pytest.raises(TypeError, match="capacity must be an integer"):
        pack([1], 8.0)
