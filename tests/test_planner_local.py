"""predict_iteration_time for a local deployment of the runtime."""

from __future__ import annotations

import math

import pytest

from afdserve.planner import perf_model as pm
from afdserve.planner import PRESETS, AttentionCost, ExpertCost, NetworkProfile, Profile, WireFormat
from afdserve.planner.local import predict_iteration_time, predict_local, tokens_per_expert_worker
from afdserve.planner.simulator import SimConfig, simulate

DEMO = PRESETS["demo"]


def _profile(**kw) -> Profile:  # type: ignore[no-untyped-def]
    base = dict(
        model="demo",
        attention=(AttentionCost(k1_tok=2e-6, k1_ctx=1e-9, k2=1e-4, tp=1, gpu="cpu"),),
        expert=(ExpertCost(k3=1e-6, k4=2e-4, tp=1, experts_per_node=4, gpu="cpu"),),
        network=NetworkProfile(latency_s=30e-6, bandwidth_Bps=2e9),
        wire=WireFormat(act_bytes=2, meta_bytes_per_token=0, dispatch="pairs"),
    )
    base.update(kw)
    return Profile(**base)


def test_hand_worked_even_micro_batches() -> None:
    prof = _profile()
    n_a, n_e, m, batch, s = 2, 2, 2, 64, 500  # 4 experts per worker, micro-batches of 32
    ta = (2e-6 + 1e-9 * 500) * 32 + 1e-4
    b_e = 32 * 2 * 2 / 2  # pairs per expert worker
    te = 1e-6 * b_e + 2e-4
    tok = 32 * 2 / 2  # hidden vectors per (attention worker, expert worker) message, "pairs"
    msg = tok * 256 * 2
    tc = 2 * (30e-6 + msg / 2e9)  # two messages serialised per endpoint
    expect = pm.iteration_time(ta, te, tc, m, DEMO.num_layers)
    got = predict_local(prof, n_a, n_e, m, batch, s, DEMO)
    assert got.ta_s == pytest.approx(ta) and got.te_s == pytest.approx(te)
    assert got.tc_a2e_s == pytest.approx(tc) and got.tc_e2a_s == pytest.approx(tc)
    assert got.iteration_s == pytest.approx(expect)
    assert predict_iteration_time(prof, n_a, n_e, m, batch, s, DEMO) == pytest.approx(expect)
    assert got.micro_batch_sizes == (32, 32) and got.experts_per_worker == 4 and not got.expert_cost_scaled


def test_step_overhead_and_meta_bytes() -> None:
    p0 = _profile()
    p1 = _profile(step_fixed_s=1e-3, step_per_token_s=1e-5, wire=WireFormat(meta_bytes_per_token=24, dispatch="pairs"))
    a = predict_local(p0, 1, 2, 1, 10, 100, DEMO)
    b = predict_local(p1, 1, 2, 1, 10, 100, DEMO)
    assert b.tc_a2e_s > a.tc_a2e_s and b.tc_e2a_s == pytest.approx(a.tc_e2a_s)
    assert b.iteration_s - b.pipeline_s == pytest.approx(1e-3 + 10 * 1e-5)


def test_uneven_micro_batches_are_simulated() -> None:
    prof = _profile()
    got = predict_local(prof, 1, 2, 3, 10, 200, DEMO)
    assert got.micro_batch_sizes == (3, 4, 3)  # the runtime's split (afdserve.config.micro_batch_sizes)
    att, exp = prof.attention[0], prof.expert[0]
    ta = [att.time(b, 200) for b in (3, 4, 3)]
    te = [exp.time(pm.expert_micro_batch(b, 1, 2, 2)) for b in (3, 4, 3)]
    sim = simulate(SimConfig(1, 2, 3, DEMO.num_layers, ta, te, got.tc_a2e_s, tc_back=got.tc_e2a_s))
    assert got.iteration_s == pytest.approx(sim.iteration_time)
    # fewer sequences than micro-batches: empty micro-batches are dropped
    assert predict_local(prof, 1, 2, 4, 2, 200, DEMO).micro_batch_sizes == (1, 1)


def test_expert_entry_scaled_to_worker_count() -> None:
    prof = _profile()
    got = predict_local(prof, 1, 4, 1, 8, 100, DEMO)  # 2 experts per worker, profile has 4
    assert got.expert_cost_scaled and got.experts_per_worker == 2
    assert got.te_s == pytest.approx(1e-6 * (8 * 2 / 4) + 2e-4 * 2 / 4)


def test_routed_dispatch_counts_distinct_workers() -> None:
    # E = 8, K = 2, 2 experts per worker: P(token misses a worker) = C(6,2)/C(8,2) = 15/28
    assert tokens_per_expert_worker(28, DEMO, 4, "routed") == pytest.approx(13)
    assert tokens_per_expert_worker(28, DEMO, 4, "pairs") == pytest.approx(14)
    assert tokens_per_expert_worker(28, DEMO, 4, "broadcast") == 28
    assert tokens_per_expert_worker(10, DEMO, 1, "routed") == pytest.approx(10)  # one worker gets every token
    assert math.comb(6, 2) / math.comb(8, 2) == pytest.approx(15 / 28)


def test_errors() -> None:
    with pytest.raises(ValueError, match="network"):
        predict_iteration_time(_profile(network=None), 1, 1, 1, 1, 1, DEMO)
    with pytest.raises(ValueError, match="attention"):
        predict_iteration_time(_profile(attention=()), 1, 1, 1, 1, 1, DEMO)
    with pytest.raises(ValueError):
        predict_iteration_time(_profile(), 0, 1, 1, 1, 1, DEMO)


# ----- the simulated runtime (profiles measured by afdserve profile carry runtime costs) ----------
from afdserve.config import micro_batch_sizes  # noqa: E402
from afdserve.planner import RuntimeCosts  # noqa: E402
from afdserve.planner.runtime_sim import RuntimeSim, simulate_runtime  # noqa: E402


def _sim(**kw) -> RuntimeSim:  # type: ignore[no-untyped-def]
    base = dict(n_a=1, n_e=1, num_layers=4, micro_batches=(8,), ta=(1e-3,), te_per_pair=0.0, te_fixed=2e-3,
                pairs=(16,), tokens=(8,), fwd_bytes=(1e4,), back_bytes=(1e4,), step_overhead=(5e-3,),
                costs=RuntimeCosts())
    base.update(kw)
    return RuntimeSim(**base)


def test_runtime_sim_serial_and_pipelined() -> None:
    # m = 1: attention and experts alternate: L * (Ta + Te) + overhead
    assert simulate_runtime(_sim()).step_s == pytest.approx(4 * 3e-3 + 5e-3)
    # m = 2 lanes, expert-bound, nothing at the step boundary: a lane that finishes begins its next
    # step at once, so the expert worker never idles: a lane's period is 2 lanes x 4 layers x Te
    pipelined = dict(micro_batches=(4, 4), ta=(1e-3, 1e-3), pairs=(8, 8), tokens=(4, 4), fwd_bytes=(1, 1),
                     back_bytes=(1, 1))
    r = simulate_runtime(_sim(step_overhead=(0.0, 0.0), **pipelined))
    assert r.step_s == pytest.approx(2 * 4 * 2e-3)
    assert r.busy[1] > 0.97
    # each lane pays its own step overhead, on the attention worker's one thread: at least
    # 2 x (4 Ta + 5 ms) per period
    slow = simulate_runtime(_sim(step_overhead=(5e-3, 5e-3), **pipelined))
    assert slow.step_s >= 2 * (4e-3 + 5e-3) - 1e-12
    # with one lane, where the overhead falls (begin or finish) does not matter
    assert simulate_runtime(_sim(begin=(2e-3,))).step_s == pytest.approx(4 * 3e-3 + 5e-3)


def test_runtime_sim_lent_cores() -> None:
    lend = ((1.0, 1.8), (100.0, 1.8))
    # m = 1 on two cores: the experts run while the attention worker waits, on both cores
    r = simulate_runtime(_sim(costs=RuntimeCosts(cores=2, lend_expert_points=lend)))
    assert r.step_s == pytest.approx(4 * (1e-3 + 2e-3 / 1.8) + 5e-3)
    # nothing to lend on one core, and pinned workers do not borrow
    assert simulate_runtime(_sim(costs=RuntimeCosts(cores=1, lend_expert_points=lend))).step_s == \
        pytest.approx(4 * 3e-3 + 5e-3)
    pinned = simulate_runtime(_sim(costs=RuntimeCosts(cores=2, lend_expert_points=lend), affinity=(0, 1)))
    assert pinned.step_s == pytest.approx(4 * 3e-3 + 5e-3)
    # the LM head borrows the expert worker's core at the step boundary
    head = RuntimeCosts(cores=2, lm_head_s=4e-3, lend_lm_head_points=((1.0, 2.0), (64.0, 2.0)))
    assert simulate_runtime(_sim(costs=head)).step_s == pytest.approx(4 * 3e-3 + 5e-3 + 2e-3)


def test_runtime_sim_costs_and_merging() -> None:
    costs = RuntimeCosts(send_s=10e-6, send_per_byte_s=1e-9, take_s=20e-6)
    r0 = simulate_runtime(_sim())
    r1 = simulate_runtime(_sim(costs=costs))
    # per layer: a dispatch (send + take) and a reply (send + take)
    assert r1.step_s - r0.step_s == pytest.approx(4 * 2 * (10e-6 + 1e4 * 1e-9 + 20e-6))
    # two attention workers in lockstep, one expert worker: same-layer messages are merged (k4 once)
    lockstep = simulate_runtime(_sim(n_a=2, te_per_pair=1e-5, stagger=0.0))
    assert lockstep.step_s == pytest.approx(4 * (1e-3 + 2e-3 + 1e-5 * 32) + 5e-3)
    # workers that start apart stay apart: the expert worker serves them one at a time
    apart = simulate_runtime(_sim(n_a=2, te_per_pair=1e-5))
    assert apart.step_s > lockstep.step_s * 1.1
    assert apart.busy[2] > lockstep.busy[2]
    # wake-up latency when a waiter slept (waited longer than spin_s)
    woke = simulate_runtime(_sim(costs=RuntimeCosts(wake_s=100e-6, spin_s=50e-6)))
    assert woke.step_s == pytest.approx(r0.step_s + 4 * 2 * 100e-6)


def test_runtime_sim_shares_cores() -> None:
    # one core: the two processes' work adds up (there is always one of them runnable)
    pipelined = dict(micro_batches=(4, 4), ta=(1e-3, 1e-3), pairs=(8, 8), tokens=(4, 4), fwd_bytes=(1, 1),
                     back_bytes=(1, 1))
    one = simulate_runtime(_sim(costs=RuntimeCosts(cores=1), step_overhead=(5e-3, 5e-3), **pipelined))
    assert one.step_s == pytest.approx(4 * 2 * (1e-3 + 2e-3) + 2 * 5e-3)
    assert simulate_runtime(_sim(costs=RuntimeCosts(cores=2), step_overhead=(5e-3, 5e-3), **pipelined)).step_s \
        < one.step_s


def test_predict_local_runtime_method() -> None:
    prof = _profile(runtime=RuntimeCosts(cores=2, send_s=1e-5, take_s=2e-5), step_fixed_s=1e-3)
    p = predict_local(prof, 2, 2, 3, 10, 200, DEMO)
    assert p.method == "runtime" and p.micro_batch_sizes == tuple(micro_batch_sizes(10, 3)) == (3, 4, 3)
    assert len(p.busy) == 4 and p.iteration_s > p.pipeline_s
    assert predict_local(prof, 2, 2, 3, 10, 200, DEMO, method="analytic").method == "analytic"
    with pytest.raises(ValueError, match="runtime"):
        predict_local(_profile(), 1, 1, 1, 4, 10, DEMO, method="runtime")
    with pytest.raises(ValueError, match="method"):
        predict_local(prof, 1, 1, 1, 4, 10, DEMO, method="magic")


def test_runtime_sim_pinning_and_corun() -> None:
    pipelined = dict(micro_batches=(4, 4), ta=(1e-3, 1e-3), pairs=(8, 8), tokens=(4, 4), fwd_bytes=(1, 1),
                     back_bytes=(1, 1), step_overhead=(5e-3, 5e-3))
    # pinned to one core == one core
    same = simulate_runtime(_sim(costs=RuntimeCosts(cores=2), affinity=(0, 0), **pipelined))
    one = simulate_runtime(_sim(costs=RuntimeCosts(cores=1), **pipelined))
    assert same.step_s == pytest.approx(one.step_s)
    apart = simulate_runtime(_sim(costs=RuntimeCosts(cores=2), affinity=(0, 1), **pipelined))
    assert apart.step_s < same.step_s
    # computing at the same time on two cores slows both; never at the same time (m = 1): no effect
    slow = RuntimeCosts(cores=2, corun_attention=1.5, corun_expert=1.5)
    assert simulate_runtime(_sim(costs=slow, affinity=(0, 1), **pipelined)).step_s > apart.step_s
    assert simulate_runtime(_sim(costs=slow)).step_s == pytest.approx(simulate_runtime(_sim()).step_s)


def test_lm_head_interpolation_and_roundtrip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from afdserve.planner import load_profile, save_profile

    rt = RuntimeCosts(cores=2, lm_head_s=1e-3, lm_head_per_token_s=1e-4,
                      lm_head_points=((1, 2e-3), (16, 5e-3), (64, 9e-3)), corun_attention=1.1)
    assert rt.lm_head_time(16) == pytest.approx(5e-3) and rt.lm_head_time(40) == pytest.approx(7e-3)
    assert rt.lm_head_time(128) == pytest.approx(1e-3 + 128e-4)  # outside the points: the fit
    prof = _profile(runtime=rt)
    save_profile(prof, tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back.runtime == rt


def test_local_pool_model_for_the_autoscaler() -> None:
    from afdserve.planner.pool_model import LocalPoolModel

    prof = _profile(runtime=RuntimeCosts(cores=8, send_s=1e-5, take_s=2e-5), step_fixed_s=1e-3)
    with pytest.raises(ValueError, match="runtime"):
        LocalPoolModel(_profile(), DEMO, 2, 64, 200, 0.05)
    pm = LocalPoolModel(prof, DEMO, 2, 64, 200, 0.05)
    # the TPOT at a demand is the step time at the least batch that produces it
    rate = 2 * 16 / pm.step(2, 1, 16)
    t = pm.tpot(2, 1, rate)
    assert t == pytest.approx(pm.step(2, 1, 16)) and pm.tpot(2, 1, rate * 0.5) < t
    assert pm.tpot(2, 1, 1e12) == math.inf
    # the capacity is the largest rate whose step meets the SLO; more attention workers serve more
    cap = pm.capacity(1, 1)
    assert 0 < cap and pm.tpot(1, 1, cap) <= 0.05 and pm.capacity(2, 1) > cap
    assert LocalPoolModel(prof, DEMO, 2, 64, 200, 1e-6).capacity(1, 1) == 0.0


def test_colocated_prediction_and_measured_expert_points() -> None:
    from afdserve.planner.costs import interp_extend

    pts = ((16.0, 2e-3), (64.0, 4e-3), (256.0, 10e-3))
    assert interp_extend(pts, 40) == pytest.approx(3e-3) and interp_extend(pts, 512) == pytest.approx(18e-3)
    assert interp_extend(pts, 0) == pytest.approx(2e-3 - 16 * 2e-3 / 48) and interp_extend(pts, -1e6) == 0.0
    rt = RuntimeCosts(cores=2, lm_head_s=1e-3, colocated_k1_tok=1e-5, colocated_k2=2e-4)
    samples = {"expert": [[8.0, 16.0, 2e-3], [8.0, 64.0, 4e-3], [8.0, 256.0, 10e-3], [4.0, 16.0, 1e-3]]}
    prof = _profile(runtime=rt, step_fixed_s=1e-3, samples=samples)
    b = 20  # 40 pairs: between the measured 16 and 64 of the worker holding all 8 experts
    p = predict_local(prof, 1, 0, 1, b, 100, DEMO)
    ta, te = 1e-5 * b + 2e-4, 3e-3
    assert p.method == "colocated" and (p.ta_s, p.te_s) == (pytest.approx(ta), pytest.approx(te))
    assert p.iteration_s == pytest.approx(DEMO.num_layers * (ta + te) + 1e-3 + 1e-3)
    # the expert worker's layer in the simulated runtime follows the same measured points
    m1 = simulate_runtime(_sim(te_points=((8.0, 1e-3), (16.0, 3e-3))))
    assert m1.step_s == pytest.approx(4 * (1e-3 + 3e-3) + 5e-3)
