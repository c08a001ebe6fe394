"""Discrete-event simulator of the ping-pong pipeline against the closed forms (Eqs. 4-5)."""

from __future__ import annotations

import itertools
import statistics

import pytest

from afdserve.planner import perf_model as pm
from afdserve.planner.simulator import SimConfig, simulate, zipf_load

CASES = [  # (Ta, Te, Tc): balanced, attention-bound, expert-bound; fast and slow links
    (1.0, 1.0, 0.2),
    (1.0, 1.0, 0.45),
    (1.0, 1.0, 0.8),
    (1.5, 1.0, 0.3),
    (1.0, 1.6, 0.3),
    (2.0, 0.5, 0.4),
    (0.5, 2.0, 0.9),
    (1.0, 1.0, 0.0),
    (1.3, 1.0, 0.0),
]


@pytest.mark.parametrize("ta,te,tc", CASES)
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_simulator_matches_eq5_where_assumptions_hold(ta: float, te: float, tc: float, m: int) -> None:
    L = 6
    r = simulate(SimConfig(n_a=3, n_e=4, micro_batches=m, num_layers=L, ta=ta, te=te, tc=tc))
    eq5 = pm.eq5_total(ta, te, tc, m, L)
    if pm.check_pipeline(ta, te, tc, m).pipeline_full:  # constraint (3): Eq. 5's assumption
        assert r.iteration_time == pytest.approx(eq5, rel=0.02)
    else:  # latency-bound pipeline: Eq. 5 is then an under-estimate
        assert r.iteration_time >= eq5 - 1e-9
    # the general closed form holds everywhere
    assert r.iteration_time == pytest.approx(pm.iteration_time(ta, te, tc, m, L), rel=1e-9)
    # each micro-batch's latency obeys Eq. 4's upper end when (3) holds (first one finishes earliest)
    lo, hi = pm.iteration_bounds(ta, te, tc, m, L)
    assert min(r.micro_batch_finish) >= lo - 1e-9


def test_m1_is_a_sequential_round_trip_per_layer() -> None:
    r = simulate(SimConfig(n_a=2, n_e=2, micro_batches=1, num_layers=5, ta=1.0, te=2.0, tc=0.5))
    assert r.iteration_time == pytest.approx(5 * (1 + 2 + 2 * 0.5))
    assert r.attention_util[0] == pytest.approx(5 / 20) and r.expert_util[0] == pytest.approx(10 / 20)


def test_utilisation_and_throughput() -> None:
    ta, te, tc, m, L = 1.0, 1.0, 0.2, 3, 8
    r = simulate(SimConfig(n_a=2, n_e=8, micro_batches=m, num_layers=L, ta=ta, te=te, tc=tc, tokens=600))
    t = pm.eq5_total(ta, te, tc, m, L)
    assert r.iteration_time == pytest.approx(t)
    assert r.mean_attention_util == pytest.approx(m * L * ta / t)
    assert r.mean_expert_util == pytest.approx(m * L * te / t)
    assert r.throughput == pytest.approx(600 / t)
    assert r.events > 0


def test_asymmetric_comm() -> None:
    r = simulate(SimConfig(n_a=1, n_e=1, micro_batches=1, num_layers=3, ta=1, te=1, tc=0.1, tc_back=0.3))
    assert r.iteration_time == pytest.approx(pm.iteration_time(1, 1, 0.1, 1, 3, tc_back=0.3))


def test_expert_skew_slows_the_iteration() -> None:
    base = dict(n_a=2, n_e=8, micro_batches=3, num_layers=6, ta=1.0, te=1.0, tc=0.2, te_fixed=0.3)
    flat = simulate(SimConfig(**base))
    load = zipf_load(8, 1.0)
    assert sum(load) / 8 == pytest.approx(1.0)
    skew = simulate(SimConfig(**base, expert_load=load))
    assert skew.iteration_time > flat.iteration_time
    # the hottest expert node sets the pace: time = Eq. 5 with its Te
    te_hot = 0.3 + 0.7 * max(load)
    assert skew.iteration_time == pytest.approx(pm.eq5_total(1.0, te_hot, 0.2, 3, 6), rel=0.02)
    assert max(skew.expert_util) == pytest.approx(max(skew.expert_util[:1]))  # node 0 is the hottest
    assert min(skew.expert_util) < max(skew.expert_util)


def test_attention_skew() -> None:
    r = simulate(
        SimConfig(n_a=2, n_e=2, micro_batches=3, num_layers=4, ta=1.0, te=0.5, tc=0.1, attention_load=[1.5, 0.5])
    )
    assert r.iteration_time == pytest.approx(pm.eq5_total(1.5, 0.5, 0.1, 3, 4), rel=0.02)
    assert r.attention_util[0] > r.attention_util[1]


def test_jitter_costs_time_on_average() -> None:
    cfg = dict(n_a=4, n_e=4, micro_batches=3, num_layers=8, ta=1.0, te=1.0, tc=0.3)
    det = simulate(SimConfig(**cfg)).iteration_time
    runs = [simulate(SimConfig(**cfg, jitter_cv=0.2, comm_jitter_cv=0.2, seed=s)).iteration_time for s in range(20)]
    assert statistics.mean(runs) > det
    assert (
        simulate(SimConfig(**cfg, jitter_cv=0.2, seed=1)).iteration_time
        == simulate(SimConfig(**cfg, jitter_cv=0.2, seed=1)).iteration_time
    )  # seeded


def test_per_micro_batch_times() -> None:
    r = simulate(SimConfig(n_a=1, n_e=1, micro_batches=2, num_layers=1, ta=[1.0, 2.0], te=[1.0, 1.0], tc=0.0))
    # A0 [0,1], A1 [1,3]; E0 [1,2], E1 [3,4]
    assert r.iteration_time == pytest.approx(4.0)
    assert r.micro_batch_finish == (pytest.approx(2.0), pytest.approx(4.0))


@pytest.mark.parametrize("bad", [dict(n_a=0), dict(ta=[1.0]), dict(expert_load=[1.0])])
def test_bad_configs(bad: dict) -> None:  # type: ignore[type-arg]
    cfg = dict(n_a=1, n_e=2, micro_batches=2, num_layers=1, ta=1.0, te=1.0, tc=0.0)
    cfg.update(bad)
    with pytest.raises(ValueError):
        SimConfig(**cfg)


def test_exhaustive_small_grid_matches_general_form() -> None:
    for ta, te, tc, m, L, na, ne in itertools.product(
        [1.0], [0.4, 1.0, 2.0], [0.0, 0.5, 1.5], [1, 2, 3, 4], [1, 4], [1, 3], [1, 4]
    ):
        r = simulate(SimConfig(na, ne, m, L, ta, te, tc))
        assert r.iteration_time == pytest.approx(pm.iteration_time(ta, te, tc, m, L), rel=1e-9)
