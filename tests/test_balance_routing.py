"""route_replicas: validity, determinism, the greedy's balance, the share split."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from afdserve.balance.placement import EMPTY, LayerPlacement, round_robin_layer
from afdserve.balance.planners import plan_janus, plan_megascale
from afdserve.balance.routing import activated_per_worker, route_replicas, route_replicas_device, tokens_per_worker
from afdserve.balance.synthetic import SyntheticRouting
from afdserve.errors import ConfigError


@st.composite
def placed_batches(draw):
    """A random valid placement (every expert somewhere, extra replicas anywhere) and a batch."""
    e = draw(st.integers(1, 24))
    n = draw(st.integers(1, 8))
    holders = []
    for expert in range(e):
        first = draw(st.integers(0, n - 1))
        extra = draw(st.sets(st.integers(0, n - 1), max_size=n))
        holders.append(sorted({first} | extra))
    per_worker = [[x for x in range(e) if w in holders[x]] for w in range(n)]
    cap = max(len(p) for p in per_worker) + draw(st.integers(0, 2))
    lp = LayerPlacement(e, tuple(tuple(p + [EMPTY] * (cap - len(p))) for p in per_worker))
    k = draw(st.integers(1, min(4, e)))
    t = draw(st.integers(0, 40))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(e)[:k] for _ in range(t)]) if t else np.zeros((0, k), dtype=np.int64)
    return lp, torch.from_numpy(ids.astype(np.int64))


@settings(max_examples=150, deadline=None)
@given(placed_batches(), st.sampled_from(["activated", "shares"]))
def test_routes_to_a_holder_deterministically(case, policy):
    lp, ids = case
    workers = route_replicas(ids, lp, policy=policy)
    assert workers.shape == ids.shape and workers.dtype == torch.int64
    for e, w in zip(ids.reshape(-1).tolist(), workers.reshape(-1).tolist()):
        assert w in lp.replicas_of(e)  # served by a worker that holds the expert
    assert torch.equal(route_replicas(ids.clone(), lp, policy=policy), workers)  # same input, same answer
    if policy == "activated" and ids.numel():
        # every activated expert uses exactly one replica in the batch
        assert int(activated_per_worker(ids, workers, lp.num_workers, lp.num_experts).sum()) == len(torch.unique(ids))


def test_single_replica_experts_have_no_choice():
    lp = round_robin_layer(8, 4, 2)
    ids = torch.tensor([[0, 7], [3, 4]])
    assert route_replicas(ids, lp).tolist() == [[0, 3], [1, 2]]


def test_greedy_balances_activated_experts():
    # expert 0..3 only on worker 0; expert 4 on workers 0 and 1: the replicated one goes to worker 1
    lp = LayerPlacement(5, ((0, 1, 2, 3, 4), (4, EMPTY, EMPTY, EMPTY, EMPTY)))
    ids = torch.tensor([[0, 4], [1, 4], [2, 3]])
    assert route_replicas(ids, lp).tolist() == [[0, 1], [0, 1], [0, 0]]
    # two experts on both workers: one each (fewest replicas first, then most tokens, then id)
    lp2 = LayerPlacement(2, ((0, 1), (0, 1)))
    w = route_replicas(torch.tensor([[0, 1], [1, 0], [1, 0]]), lp2)
    assert sorted(set(w[:, 0].tolist()) | set(w[:, 1].tolist())) == [0, 1]
    assert activated_per_worker(torch.tensor([[0, 1], [1, 0], [1, 0]]), w, 2, 2).tolist() == [1, 1]


def test_greedy_beats_random_replica_choice():
    sr = SyntheticRouting.make(1, 64, 8, seed=3)
    lp = plan_janus(sr.snapshot(128, 8), 8, 10).layers[0]
    g = torch.Generator().manual_seed(7)
    rng = np.random.default_rng(0)
    greedy, rand = [], []
    for _ in range(30):
        ids = sr.sample(0, 64, g)
        act = activated_per_worker(ids, route_replicas(ids, lp), 8, 64)
        greedy.append(int(act.max() - act.min()))
        choice = torch.tensor([rng.choice(lp.replicas_of(e)) for e in range(64)])
        act_r = activated_per_worker(ids, choice[ids], 8, 64)
        rand.append(int(act_r.max() - act_r.min()))
    assert np.mean(greedy) < np.mean(rand)


def test_shares_split_tokens_in_planned_fractions():
    lp = LayerPlacement(2, ((0, 1), (0, EMPTY)), shares=((0.25, 1.0), (0.75, 0.0)))
    lp.validate()
    ids = torch.zeros(400, 1, dtype=torch.int64)
    w = route_replicas(ids, lp, policy="shares")
    assert tokens_per_worker(w, 2).tolist() == [100, 300]
    assert w[:100].eq(0).all() and w[100:].eq(1).all()  # contiguous in token order
    # without shares: even split
    even = LayerPlacement(2, ((0, 1), (0, EMPTY)))
    assert tokens_per_worker(route_replicas(ids, even, policy="shares"), 2).tolist() == [200, 200]


def test_megascale_plan_with_shares_balances_tokens():
    sr = SyntheticRouting.make(1, 32, 4, seed=5)
    lp = plan_megascale(sr.snapshot(256, 8), 4, 10).layers[0]
    lp.validate()
    g = torch.Generator().manual_seed(9)
    tok = sum(tokens_per_worker(route_replicas(sr.sample(0, 256, g), lp, policy="shares"), 4) for _ in range(10))
    rr = round_robin_layer(32, 4, 10)
    g = torch.Generator().manual_seed(9)
    tok_rr = sum(tokens_per_worker(route_replicas(sr.sample(0, 256, g), rr), 4) for _ in range(10))
    assert tok.max() < tok_rr.max()


def test_bad_input():
    lp = round_robin_layer(4, 2, 2)
    with pytest.raises(ConfigError):
        route_replicas(torch.tensor([[4]]), lp)
    with pytest.raises(ConfigError):
        route_replicas(torch.tensor([[-1]]), lp)
    with pytest.raises(ConfigError):
        route_replicas(torch.tensor([[0]]), lp, policy="nope")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="no replica"):
        route_replicas(torch.tensor([[0]]), LayerPlacement(4, ((0, 1), (2, EMPTY))))
    assert route_replicas(torch.zeros(0, 2, dtype=torch.int64), lp).shape == (0, 2)


@settings(max_examples=300, deadline=None)
@given(placed_batches(), st.booleans())
def test_the_device_routing_is_the_host_routing(case, skew):
    """route_replicas_device (tensor ops, no host read) chooses as route_replicas does, step for
    step of the greedy, on uniform and on skewed batches (ties between replicas included)."""
    lp, ids = case
    if skew and ids.numel():  # most tokens on the lowest experts: counts tie and differ more
        ids = torch.where(torch.rand(ids.shape, generator=torch.Generator().manual_seed(ids.numel())) < 0.7,
                          ids % max(1, min(3, lp.num_experts)), ids)
        ids = torch.stack([r if len(set(r.tolist())) == len(r) else torch.arange(len(r)) for r in ids]) \
            if ids.shape[1] <= lp.num_experts else ids
    assert torch.equal(route_replicas_device(ids, lp), route_replicas(ids, lp))
