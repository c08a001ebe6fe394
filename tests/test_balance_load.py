"""LoadTracker / LoadSnapshot: counts against brute force, the sliding window, merge, JSON."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afdserve.balance.load import LoadSnapshot, LoadTracker
from afdserve.errors import ConfigError


def brute_force(ids: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.zeros(num_experts, dtype=np.int64)
    co = np.zeros((num_experts, num_experts), dtype=np.int64)
    for row in ids:
        for e in row:
            tokens[e] += 1
        for a, b in itertools.permutations(row, 2):
            co[a, b] += 1
    return tokens, co


@st.composite
def batches(draw):
    e = draw(st.integers(1, 12))
    k = draw(st.integers(1, min(4, e)))
    t = draw(st.integers(0, 20))
    rows = [draw(st.permutations(range(e)))[:k] for _ in range(t)]
    return e, k, np.array(rows, dtype=np.int64).reshape(t, k)


@settings(max_examples=60, deadline=None)
@given(batches())
def test_record_matches_brute_force(batch):
    e, k, ids = batch
    tracker = LoadTracker(2, e, window=4)
    tracker.record(1, torch.from_numpy(ids))
    snap = tracker.snapshot()
    tokens, co = brute_force(ids, e)
    assert np.array_equal(snap.tokens[1], tokens)
    assert np.array_equal(snap.coactivation[1], co)
    assert not snap.tokens[0].any() and not snap.coactivation[0].any()
    assert np.array_equal(snap.coactivation[1], snap.coactivation[1].T)
    assert snap.steps == (1 if ids.size else 0)


def test_sliding_window_keeps_last_w_steps():
    tracker = LoadTracker(1, 4, window=3)
    for step in range(6):  # step s routes one token to expert s % 4
        tracker.record(0, torch.tensor([[step % 4]]))
        tracker.step()
    # after the 6th step(): the (empty) step in progress + steps 4 and 5
    snap = tracker.snapshot()
    assert snap.steps == 2
    assert snap.tokens[0].tolist() == [1, 1, 0, 0]
    tracker.record(0, torch.tensor([[3]]))
    snap = tracker.snapshot()
    assert snap.steps == 3 and snap.tokens[0].tolist() == [1, 1, 0, 1]


def test_coarse_slots():
    tracker = LoadTracker(1, 2, window=4, slots=2)  # two slots of two steps
    for step in range(5):
        tracker.record(0, torch.tensor([[step % 2]]))
        tracker.step()
    snap = tracker.snapshot()  # slot 0 (steps 0, 1) was cleared when step 3 ended; it now holds step 4
    assert snap.steps == 3 and snap.tokens[0].tolist() == [2, 1]
    with pytest.raises(ConfigError):
        LoadTracker(1, 2, window=5, slots=2)


def test_micro_batches_add_up_and_no_coactivation():
    tracker = LoadTracker(3, 8, window=2, coactivation=False)
    a = torch.tensor([[0, 1], [2, 3]])
    tracker.record(2, a)
    tracker.record(2, a)
    snap = tracker.snapshot()
    assert snap.coactivation is None
    assert snap.tokens[2].tolist() == [2, 2, 2, 2, 0, 0, 0, 0]


def test_merge_and_json(tmp_path):
    t1, t2 = LoadTracker(2, 5, window=8), LoadTracker(2, 5, window=8)
    for _ in range(3):
        t1.record(0, torch.tensor([[0, 1, 2]]))
        t1.step()
    t2.record(1, torch.tensor([[4, 3]]))
    t2.step()
    s1, s2 = t1.snapshot(), t2.snapshot()
    merged = LoadSnapshot.merge([s1, s2])
    assert merged.steps == 3
    assert np.array_equal(merged.tokens, s1.tokens + s2.tokens)
    assert np.array_equal(merged.coactivation, s1.coactivation + s2.coactivation)
    assert np.array_equal((s1 + s2).tokens, merged.tokens)
    back = LoadSnapshot.from_json(merged.to_json())
    assert back.steps == merged.steps
    assert np.array_equal(back.tokens, merged.tokens) and np.array_equal(back.coactivation, merged.coactivation)
    path = tmp_path / "snap.json"
    merged.save(path)
    assert np.array_equal(LoadSnapshot.load(path).tokens, merged.tokens)
    no_co = LoadSnapshot(tokens=np.ones((2, 5)), coactivation=None, steps=1)
    assert LoadSnapshot.merge([merged, no_co]).coactivation is None
    assert LoadSnapshot.from_json(no_co.to_json()).coactivation is None
    with pytest.raises(ConfigError):
        LoadSnapshot.from_json('{"format": "something else"}')
    with pytest.raises(ConfigError):
        LoadSnapshot.merge([merged, LoadSnapshot(tokens=np.ones((1, 5)), coactivation=None, steps=1)])


def test_rejects_bad_layer():
    with pytest.raises(ConfigError):
        LoadTracker(2, 4).record(2, torch.tensor([[0]]))


def test_coactivation_is_sampled_and_scaled_to_the_window():
    """Co-activation is recorded in one step of every ``coactivation_every`` (tracking costs one
    update per layer in the others); the snapshot scales it to all of the window's steps."""
    ids = torch.tensor([[0, 1], [0, 1], [2, 3]])
    every = LoadTracker(1, 4, window=64, coactivation_every=4)
    always = LoadTracker(1, 4, window=64, coactivation_every=1)
    for _ in range(16):
        for t in (every, always):
            t.record(0, ids)
            t.step()
    a, b = every.snapshot(), always.snapshot()
    assert np.array_equal(a.tokens, b.tokens) and a.steps == b.steps == 16
    assert np.array_equal(a.coactivation, b.coactivation)  # the same routing every step: exact
    assert b.coactivation[0, 0, 1] == 32 and b.coactivation[0, 2, 3] == 16
