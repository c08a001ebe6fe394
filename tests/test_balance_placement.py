"""Placement data structure and the planners: property tests and the gap to the exact optimum."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afdserve.balance.exact import count_candidates, plan_exact
from afdserve.balance.load import LoadSnapshot
from afdserve.balance.objective import KINDS, layer_load, objective, worker_costs
from afdserve.balance.placement import (
    EMPTY,
    LayerPlacement,
    Placement,
    align_slots,
    round_robin,
    round_robin_layer,
    slot_changes,
    slots_from_memory,
)
from afdserve.balance.planners import plan_janus, plan_layer, plan_megascale, replica_counts
from afdserve.balance.synthetic import synthetic_snapshot
from afdserve.errors import ConfigError


def plan(kind: str, snap: LoadSnapshot, n: int, caps, cold_cost: float = 0.0) -> Placement:
    return plan_megascale(snap, n, caps, cold_cost=cold_cost) if kind == "megascale" else plan_janus(snap, n, caps)


# ---------------------------------------------------------------- data structure


def test_round_robin_contiguous_uneven():
    lp = round_robin_layer(10, 4, 3)
    assert lp.slots == ((0, 1, 2), (3, 4, 5), (6, 7, EMPTY), (8, 9, EMPTY))
    lp.validate((3, 3, 3, 3))
    assert lp.replicas_of(7) == (2,)
    assert lp.physical_to_logical()[6:9] == [6, 7, EMPTY]
    assert lp.logical_to_physical()[8] == [9]
    het = round_robin_layer(6, 3, (1, 4, 2))
    assert het.slots == ((0,), (1, 2, 3, EMPTY), (4, 5))
    with pytest.raises(ConfigError):
        round_robin_layer(7, 2, 3)


def test_validate_rejects_bad_placements():
    with pytest.raises(ConfigError, match="no replica"):
        LayerPlacement(3, ((0, 1), (1, EMPTY))).validate()
    with pytest.raises(ConfigError, match="twice"):
        LayerPlacement(2, ((0, 0), (1, EMPTY))).validate()
    with pytest.raises(ConfigError, match="unknown"):
        LayerPlacement(2, ((0, 5), (1, EMPTY))).validate()
    with pytest.raises(ConfigError, match="slots"):
        Placement((LayerPlacement(2, ((0,), (1,))), LayerPlacement(2, ((0, 1), (1, EMPTY))))).validate()


def test_json_roundtrip_align_and_changes():
    snap = synthetic_snapshot(2, 8, 2, seed=3)
    new = plan_janus(snap, 3, 4)
    assert Placement.from_json(new.to_json()) == new
    old = round_robin(8, 3, 4, num_layers=2)
    aligned = align_slots(new, old)
    aligned.validate()
    for a, b in zip(aligned.layers, new.layers):  # same sets per worker, only slot order changed
        assert [sorted(a.experts_on(w)) for w in range(3)] == [sorted(b.experts_on(w)) for w in range(3)]
    assert len(slot_changes(old, aligned)) <= len(slot_changes(old, new))
    for c in slot_changes(old, aligned):  # an expert a worker keeps never moves slot
        assert c.old == EMPTY or c.old not in aligned.layers[c.layer].experts_on(c.worker)


def test_slots_from_memory():
    assert slots_from_memory([10_000, 25_000], expert_bytes=100, num_layers=10) == [10, 25]


# ---------------------------------------------------------------- planners: properties


@st.composite
def instances(draw):
    e = draw(st.integers(2, 20))
    n = draw(st.integers(1, 6))
    if draw(st.booleans()):
        c = draw(st.integers(-(-e // n), -(-e // n) + 4))
        caps = (c,) * n
    else:  # heterogeneous memory
        caps = tuple(draw(st.lists(st.integers(0, e), min_size=n, max_size=n)))
        if sum(caps) < e:
            caps = caps[:-1] + (caps[-1] + e - sum(caps),)
    k = draw(st.integers(1, min(4, e)))
    snap = synthetic_snapshot(
        draw(st.integers(1, 2)), e, k, tokens_per_step=draw(st.integers(1, 48)), steps=2,
        skew=draw(st.floats(0.0, 2.5)), groups=draw(st.integers(1, 4)), seed=draw(st.integers(0, 10_000)),
    )
    return snap, n, caps


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances(), st.sampled_from(KINDS), st.sampled_from([0.0, 5.0]))
def test_planner_properties(inst, kind, cold_cost):
    snap, n, caps = inst
    p = plan(kind, snap, n, caps, cold_cost)
    p.validate()  # every expert placed, no expert twice on a worker, ids in range
    assert p.capacities == tuple(caps)  # slot (memory) limit of every worker
    assert p.num_layers == snap.num_layers
    rr = round_robin(snap.num_experts, n, caps, snap.num_layers)
    assert objective(p, snap, kind, cold_cost=cold_cost) <= objective(rr, snap, kind, cold_cost=cold_cost) * (1 + 1e-9) + 1e-12
    assert plan(kind, snap, n, caps, cold_cost) == p  # deterministic


@settings(max_examples=80, deadline=None)
@given(instances(), st.sampled_from(KINDS))
def test_replicas_use_every_slot(inst, kind):
    """Without the round-robin guard the plan fills every slot it can: min(C_w, E) per worker."""
    snap, n, caps = inst
    load, coact = layer_load(snap, 0, kind)
    lp, _ = plan_layer(load, coact, kind, caps, guard=False)
    lp.validate(caps)
    want = sum(min(c, snap.num_experts) for c in caps)
    assert int(lp.replica_counts().sum()) == want
    assert np.array_equal(lp.replica_counts(), replica_counts(load, caps))


def test_hot_expert_gets_replicas():
    tokens = np.array([[100, 10, 10, 10, 10, 10]])
    snap = LoadSnapshot(tokens=tokens, coactivation=np.zeros((1, 6, 6), dtype=np.int64), steps=1)
    p = plan_megascale(snap, 3, 3)
    assert p.replicas_of(0, 0) == [0, 1, 2]
    assert replica_counts(tokens[0].astype(float), (3, 3, 3)).tolist() == [3, 2, 1, 1, 1, 1]


def test_janus_needs_coactivation():
    snap = LoadSnapshot(tokens=np.ones((1, 4)), coactivation=None, steps=1)
    with pytest.raises(ConfigError, match="co-activation"):
        plan_janus(snap, 2, 2)
    with pytest.raises(ConfigError):
        plan_megascale(snap, 2, 1)  # 4 experts, 2 slots


def test_janus_separates_coactivated_pairs():
    # experts (0,1) and (2,3) always together; 2 workers x 2 slots: each pair must be split
    co = np.zeros((1, 4, 4), dtype=np.int64)
    co[0, 0, 1] = co[0, 1, 0] = co[0, 2, 3] = co[0, 3, 2] = 50
    snap = LoadSnapshot(tokens=np.full((1, 4), 50), coactivation=co, steps=1)
    lp = plan_janus(snap, 2, 2).layers[0]
    for w in range(2):
        assert sorted(lp.experts_on(w)) not in ([0, 1], [2, 3])
    # I(g) = own tokens (50 + 50) and no co-activated pair
    assert objective(plan_janus(snap, 2, 2), snap, "janus") == pytest.approx(100.0)
    assert objective(round_robin(4, 2, 2), snap, "janus") == pytest.approx(150.0)


# ---------------------------------------------------------------- exact solver and gap report

GAP_CASES = [  # (experts, workers, slots per worker, top-k)
    (4, 2, 3, 2), (5, 2, 3, 2), (5, 3, 2, 2), (6, 2, 4, 2), (6, 3, 2, 3), (6, 3, 3, 2), (5, 4, 2, 2), (6, 2, (4, 2), 2),
]
SEEDS = range(5)


def _gap(value: float, best: float) -> float:
    if best <= 0:
        return 0.0 if value <= 1e-12 else float("inf")
    return value / best - 1.0


def test_exact_is_optimal_on_a_tiny_instance():
    snap = synthetic_snapshot(1, 4, 2, seed=1)
    ex = plan_exact(snap, 2, 2, kind="megascale")
    ex.validate()
    # brute force over the 3 ways to split 4 experts into two pairs (no room for replicas)
    best = min(
        objective(Placement((LayerPlacement(4, (a, tuple(sorted(set(range(4)) - set(a))))),)), snap, "megascale")
        for a in [(0, 1), (0, 2), (0, 3)]
    )
    assert objective(ex, snap, "megascale") == pytest.approx(best)
    with pytest.raises(ConfigError, match="max_candidates"):
        plan_exact(snap, 2, 2, max_candidates=3)
    assert count_candidates(4, (2, 2)) == 66 and count_candidates(4, (2, 2), fill=True) == 21


def _summary(pairs: list[tuple[float, float]]) -> str:
    """'mean / max' relative gap over instances with a positive optimum, + how many were optimal."""
    gaps = [v / b - 1.0 for v, b in pairs if b > 1e-12]
    opt = sum(v <= b + 1e-9 * max(1.0, b) for v, b in pairs)
    zero = len(pairs) - len(gaps)
    text = f"{np.mean(gaps):.1%} / {np.max(gaps):.1%}" if gaps else "-"
    return f"{text} ({opt}/{len(pairs)} opt{f', {zero} with optimum 0' if zero else ''})"


@pytest.mark.parametrize("kind", KINDS)
def test_gap_to_exact(kind, capsys):
    """Planner vs exhaustive search; prints the gap table of docs/balance.md."""
    rows = []
    for e, n, c, k in GAP_CASES:
        caps = c if isinstance(c, tuple) else (c,) * n
        cols: dict[str, list[tuple[float, float]]] = {"free": [], "fill": [], "rule": [], "rr": []}
        fired = 0
        for seed in SEEDS:
            snap = synthetic_snapshot(1, e, k, tokens_per_step=16, steps=4, skew=1.0, groups=2, seed=seed)
            v = objective(plan(kind, snap, n, caps), snap, kind)
            load, coact = layer_load(snap, 0, kind)
            unguarded, _ = plan_layer(load, coact, kind, caps, guard=False)
            v_unguarded = float(worker_costs(unguarded, load, coact, kind).max())
            best = {r: objective(plan_exact(snap, n, caps, kind=kind, replicas=r), snap, kind) for r in ("free", "fill", "rule")}
            v_rr = objective(round_robin(e, n, caps), snap, kind)
            assert v >= best["free"] - 1e-9  # nothing beats the exhaustive optimum
            assert v_unguarded >= best["fill"] - 1e-9  # ... among placements that use every slot
            assert v_unguarded >= best["rule"] - 1e-9  # ... nor with the same replica counts
            assert v <= v_rr + 1e-9
            cols["free"].append((v, best["free"]))
            cols["fill"].append((v_unguarded, best["fill"]))
            cols["rule"].append((v_unguarded, best["rule"]))
            cols["rr"].append((v_rr, best["free"]))
            fired += v < v_unguarded - 1e-9  # the round-robin guard replaced the plan
        rows.append((e, n, caps, k, count_candidates(e, caps), cols, fired))
    with capsys.disabled():
        print(f"\n[{kind}] gap = planner / exact - 1, mean / max over {len(SEEDS)} seeds (instances with optimum 0 left out of the mean)")
        print("| E | N | slots | k | placements | plan vs best placement | plan (no guard) vs best using all slots | plan (no guard) vs best with the same replica counts | round-robin vs best placement | guard fired |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for e, n, caps, k, cand, cols, fired in rows:
            print(
                f"| {e} | {n} | {'+'.join(map(str, caps))} | {k} | {cand} | {_summary(cols['free'])} | {_summary(cols['fill'])} "
                f"| {_summary(cols['rule'])} | {_summary(cols['rr'])} | {fired}/{len(SEEDS)} |"
            )
