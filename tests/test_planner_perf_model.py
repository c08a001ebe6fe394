"""Each equation of the performance model against hand-worked cases (MegaScale-Infer §2.3, §4.1-4.2)."""

from __future__ import annotations

import math

import pytest

from afdserve.planner import perf_model as pm
from afdserve.planner import roofline
from afdserve.planner.catalog import BUILTIN_GPUS
from afdserve.planner import PRESETS, UtilCurve

MIXTRAL = PRESETS["mixtral-8x22b"]


# ----- §2.3 roofline example -------------------------------------------------------------------
def test_roofline_batch_a100_paper_example() -> None:
    # 312 TFLOPS / 2 TB/s = 156 tokens
    assert roofline.roofline_batch(312e12, 2e12) == pytest.approx(156.0)
    # the catalog A100 (2,039 GB/s) gives ~153, i.e. "about 156"
    assert BUILTIN_GPUS["A100"].ridge_batch == pytest.approx(156.0, rel=0.025)


def test_moe_ffn_utilization_paper_example() -> None:
    # 156 tokens, top-2 of 8 experts: 39 tokens per expert, 25% FFN utilisation
    assert pm.expert_micro_batch(156, n_a=1, top_k=2, n_e=8) == pytest.approx(39.0)
    assert roofline.moe_ffn_utilization(156, 2, 8, 312e12, 2e12) == pytest.approx(0.25)
    # dense model (K = E) at the ridge point is fully utilised; the bound saturates at 1
    assert roofline.moe_ffn_utilization(156, 8, 8, 312e12, 2e12) == pytest.approx(1.0)
    assert roofline.moe_ffn_utilization(10_000, 2, 8, 312e12, 2e12) == 1.0


def test_roofline_batch_fp8_halves_bytes() -> None:
    assert roofline.roofline_batch(312e12, 2e12, bytes_per_param=1.0) == pytest.approx(78.0)


# ----- §7.3 message size, Eq. (6) ---------------------------------------------------------------
def test_a2e_bytes_per_pair_paper_example() -> None:
    # Mixtral 8x22B, micro-batch 128, tp_a = 2: 128 * 2/8 * 6144 * 2 / 2 = 196,608 bytes
    got = pm.a2e_bytes_per_pair(128, MIXTRAL.hidden_size, MIXTRAL.top_k, MIXTRAL.num_experts, tp_a=2)
    assert got == 196_608


def test_comm_time_eq6_ideal_and_curve() -> None:
    h, K, tp_a, n_e, n_a = 6144, 2, 2, 8, 4
    send = pm.a2e_bytes_per_gpu(128, h, K, tp_a)  # 128*6144*2*2/2
    assert send == 1_572_864
    b_e = pm.expert_micro_batch(128, n_a, K, n_e)
    assert b_e == 128
    recv = pm.expert_recv_bytes_per_gpu(b_e, h, tp_e=1)
    assert recv == 1_572_864
    w = 200e9 / 8  # 200 Gb/s
    assert pm.comm_time(send, n_e, w, recv, n_a * tp_a, w) == pytest.approx(1_572_864 / 25e9)
    # Util(196,608 B) = 0.8 * 196608 / (196608 + 65536) = 0.6
    util = UtilCurve(peak=0.8, half_bytes=65536)
    assert util(196_608) == pytest.approx(0.6)
    # receive side has 8 peers -> 196,608 B each as well
    assert pm.comm_time(send, n_e, w, recv, n_a * tp_a, w, util) == pytest.approx(1_572_864 / (25e9 * 0.6))
    # the slower side wins: halve the expert bandwidth
    assert pm.comm_time(send, n_e, w, recv, 8, w / 2, util) == pytest.approx(1_572_864 / (12.5e9 * 0.6))


def test_util_curve_points_interpolate_in_log_size() -> None:
    u = UtilCurve(points=((1024.0, 0.1), (1024.0 * 1024, 0.9)))
    assert u(1024) == pytest.approx(0.1)
    assert u(32 * 1024) == pytest.approx(0.5)  # halfway in log2 between 2^10 and 2^20
    assert u(1) == pytest.approx(0.1) and u(1e12) == pytest.approx(0.9)
    assert UtilCurve().is_ideal and UtilCurve()(123) == 1.0


# ----- constraint (1): balance ------------------------------------------------------------------
def test_balance_rule() -> None:
    # n_a = k1 * E / (k3 * K)
    assert pm.balance_n_a(k1=2e-6, k3=1e-6, n_e=8, top_k=2) == pytest.approx(8.0)
    # and it balances the token-proportional parts: k1*b_a == k3*b_e
    n_a = pm.balance_n_a(3e-6, 1.5e-6, 16, 4)
    b_a = 100
    assert 3e-6 * b_a == pytest.approx(1.5e-6 * pm.expert_micro_batch(b_a, n_a, 4, 16))


def test_token_conservation() -> None:
    # b_a * m * n_a = b_e * m * E / K = B
    b_a, m, n_a, E, K = 96, 3, 5, 16, 4
    b_e = pm.expert_micro_batch(b_a, n_a, K, E)
    assert pm.global_batch(b_a, m, n_a) == pytest.approx(b_e * m * E / K) == 1440


# ----- constraints (2), (3) ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "tc,expected",
    [(0.0, 2), (0.4, 3), (0.5, 3), (0.6, 4), (0.99, 4), (1.5, 5)],
)
def test_min_micro_batches_eq3(tc: float, expected: int) -> None:
    assert pm.min_micro_batches(tc, 1.0) == expected


def test_check_pipeline() -> None:
    c = pm.check_pipeline(ta=1.0, te=1.0, tc=0.4, m=3)
    assert c.balanced and c.comm_hidden and c.pipeline_full and c.min_micro_batches == 3
    c = pm.check_pipeline(ta=1.0, te=2.0, tc=2.5, m=3)
    assert not c.balanced and not c.comm_hidden and not c.pipeline_full
    assert c.balance_ratio == pytest.approx(0.5)
    assert c.min_micro_batches == math.ceil(2 * (1 + 2.5 / 2.0))


# ----- Eqs. (4), (5) ----------------------------------------------------------------------------
def test_eq4_eq5_hand_worked() -> None:
    ta, te, tc, m, L = 1.0, 2.0, 0.5, 3, 4
    # Eq. 5: (1 + 2 + 2*0.5) + 2*(3*4 - 1) = 4 + 22
    assert pm.eq5_total(ta, te, tc, m, L) == pytest.approx(26.0)
    lo, hi = pm.iteration_bounds(ta, te, tc, m, L)
    assert lo == pytest.approx(4 + 3 * 2 * 3) and hi == pytest.approx(3 * 2 * 4)
    assert lo <= hi <= pm.eq5_total(ta, te, tc, m, L)


def test_iteration_time_general_form() -> None:
    # equals Eq. 5 when (3) holds
    assert pm.iteration_time(1.0, 2.0, 0.5, 3, 4) == pytest.approx(pm.eq5_total(1.0, 2.0, 0.5, 3, 4))
    # m = 1: no pipelining, L full round trips
    assert pm.iteration_time(1.0, 2.0, 0.5, 1, 4) == pytest.approx(4 * (1 + 2 + 1))
    # (3) violated: latency-bound layers; Eq. 5 under-estimates
    t = pm.iteration_time(1.0, 1.0, 1.0, 2, 5)
    assert t == pytest.approx(4 + 4 * 4 + 1)
    assert t > pm.eq5_total(1.0, 1.0, 1.0, 2, 5)
    # asymmetric A2E / E2A
    assert pm.iteration_time(1.0, 1.0, 0.2, 1, 2, tc_back=0.4) == pytest.approx(2 * 2.6)


def test_eq7_slo() -> None:
    assert pm.meets_slo(0.150, 0.150) and not pm.meets_slo(0.1501, 0.150)


# ----- Eq. (8) ----------------------------------------------------------------------------------
def test_eq8_kv_memory_matches_paper_form() -> None:
    s = MIXTRAL
    m, b_a, seq, tp_a = 3, 128, 650, 2
    paper = 4 * m * b_a * seq * s.hidden_size * s.num_layers / s.gqa_group  # bf16, h/g = kv dims
    assert pm.kv_cache_bytes(s, m, b_a, seq, tp_a) == pytest.approx(paper)
    lhs = paper + 2 * s.attention_side_params
    assert pm.attention_memory_bytes(s, m, b_a, seq, tp_a) == pytest.approx(lhs)
    cap = 80e9
    assert pm.attention_memory_ok(s, m, b_a, seq, tp_a, cap) == (lhs < tp_a * cap)


def test_eq8_max_batch_is_tight() -> None:
    s, m, seq, tp_a, cap = MIXTRAL, 3, 650, 2, 80e9
    b = pm.max_b_a_for_memory(s, m, seq, tp_a, cap)
    assert b > 0
    assert pm.attention_memory_ok(s, m, b, seq, tp_a, cap)
    assert not pm.attention_memory_ok(s, m, b + 1, seq, tp_a, cap)
    # 5 GB cannot even hold Mixtral's ~10.7 GB of attention-side weights
    assert pm.max_b_a_for_memory(s, 1, seq, 1, 5e9) == 0


def test_kv_replication_gqa_and_mla() -> None:
    q = PRESETS["qwen3-235b-a22b"]  # 4 KV heads
    assert q.kv_replication(4) == 1 and q.kv_replication(8) == 2
    d = PRESETS["deepseek-v3"]  # MLA latent: every TP rank keeps it
    assert d.kv_replication(4) == 4
    assert d.kv_bytes_per_token_layer == (512 + 64) * 2


# ----- objective --------------------------------------------------------------------------------
def test_throughput_per_cost_and_watt() -> None:
    e = pm.efficiency(1000, 0.1, tp_a=2, n_a=3, tp_e=1, n_e=8, price_a=1.85, price_e=1.08, power_a=500, power_e=350)
    assert e.throughput_tok_s == pytest.approx(10_000)
    assert e.num_gpus == 14
    assert e.cost == pytest.approx(2 * 3 * 1.85 + 8 * 1.08)
    assert e.throughput_per_cost == pytest.approx(10_000 / 19.74)
    assert e.throughput_per_gpu == pytest.approx(10_000 / 14)
    assert e.throughput_per_watt == pytest.approx(10_000 / (6 * 500 + 8 * 350))
    assert pm.efficiency(1, 1, 1, 1, 1, 1, None, 1.0, 1, 1).throughput_per_cost is None


# ----- roofline constants -----------------------------------------------------------------------
def test_roofline_expert_constants_hand_worked() -> None:
    a100 = BUILTIN_GPUS["A100"]
    c = roofline.expert_cost(MIXTRAL, a100, tp=1)
    params = 3 * 6144 * 16384
    assert c.k4 == pytest.approx(params * 2 / 2039e9)  # stream one expert's weights
    assert c.k3 == pytest.approx(2 * params / 312e12)  # 2 FLOPs per weight per token
    c2 = roofline.expert_cost(MIXTRAL, a100, tp=2, experts_per_node=2)
    allreduce = 2 * (1 / 2) * 6144 * 2 / (600e9 / 2)
    assert c2.k4 == pytest.approx(c.k4)  # two experts, split over two GPUs
    assert c2.k3 == pytest.approx(c.k3 / 2 + allreduce)


def test_roofline_attention_constants_hand_worked() -> None:
    a100 = BUILTIN_GPUS["A100"]
    s = MIXTRAL
    c = roofline.attention_cost(s, a100, tp=1)
    p = s.attention_params_per_layer + s.router_params_per_layer
    assert p == 6144 * 6144 * 2 + 2 * 6144 * 1024 + 6144 * 8
    assert c.k2 == pytest.approx(p * 2 / 2039e9)
    assert c.k1_tok == pytest.approx(2 * p / 312e12)
    kv = 2 * 8 * 128 * 2  # bytes per cached token per layer
    assert c.k1_ctx == pytest.approx(kv / 2039e9 + 4 * 48 * 128 / 312e12)
    assert c.time(10, 100) == pytest.approx((c.k1_tok + 100 * c.k1_ctx) * 10 + c.k2)
