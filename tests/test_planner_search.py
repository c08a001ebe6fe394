"""Algorithm 1: the search's plans are feasible, maximal and ranked; heterogeneous pairs."""

from __future__ import annotations

import math

import pytest

from afdserve.errors import ConfigError
from afdserve.planner import perf_model as pm
from afdserve.planner.catalog import BUILTIN_GPUS, load_catalog
from afdserve.planner import (
    PRESETS,
    AttentionCost,
    ExpertCost,
    NetworkProfile,
    Profile,
    SearchConfig,
    compare_hetero,
    evaluate,
    search,
)
from afdserve.planner.cost_source import CostSource
from afdserve.planner.evaluator import evaluators
from afdserve.planner.search import sweep

A800, H20, L40S = BUILTIN_GPUS["A800"], BUILTIN_GPUS["H20"], BUILTIN_GPUS["L40S"]
MIXTRAL, DBRX = PRESETS["mixtral-8x22b"], PRESETS["dbrx"]


@pytest.fixture(scope="module")
def mixtral_a800():  # type: ignore[no-untyped-def]
    return search(MIXTRAL, [A800], config=SearchConfig())


def test_homogeneous_plans_are_feasible_and_maximal(mixtral_a800) -> None:  # type: ignore[no-untyped-def]
    res = mixtral_a800
    cfg = SearchConfig()
    assert res.objective == "cost" and res.estimate and res.plans
    for p in res.plans[:50]:
        assert p.attention_gpu == p.expert_gpu == "A800"
        assert p.tp_a in (1, 2, 4, 8) and p.tp_e in (1, 2, 4, 8) and 1 <= p.micro_batches <= 4
        assert p.batch == p.b_a * p.micro_batches * p.n_a
        assert p.n_e * p.experts_per_node == MIXTRAL.num_experts
        assert p.tbt_s <= cfg.slo_s  # Eq. 7
        assert pm.attention_memory_ok(MIXTRAL, p.micro_batches, p.b_a, cfg.seq_len, p.tp_a, A800.memory_bytes)  # Eq. 8
        assert p.tbt_s == pytest.approx(pm.iteration_time(p.ta_s, p.te_s, p.tc_s, p.micro_batches, MIXTRAL.num_layers))
        # maximal: one more token per micro-batch breaks the SLO or the memory limit
        nxt = evaluate(
            MIXTRAL,
            A800,
            A800,
            tp_a=p.tp_a,
            tp_e=p.tp_e,
            n_a=p.n_a,
            micro_batches=p.micro_batches,
            experts_per_node=p.experts_per_node,
            b_a=p.b_a + 1,
        )
        assert nxt is not None
        assert nxt.tbt_s > cfg.slo_s or not pm.attention_memory_ok(
            MIXTRAL, p.micro_batches, p.b_a + 1, cfg.seq_len, p.tp_a, A800.memory_bytes
        )
        assert p.throughput_per_cost == pytest.approx(p.throughput_tok_s / p.cost)
        assert p.cost == pytest.approx((p.tp_a * p.n_a + p.tp_e * p.n_e) * 2.26)


def test_ranking_is_by_objective(mixtral_a800) -> None:  # type: ignore[no-untyped-def]
    vals = [p.throughput_per_cost for p in mixtral_a800.plans]
    assert vals == sorted(vals, reverse=True)
    best = mixtral_a800.best
    assert best is not None and best.comm_hidden and best.pipeline_full


def test_closed_form_batch_limit_equals_binary_search() -> None:
    cfg = SearchConfig(link_latency_s=15e-6)
    checked = 0
    for spec in (MIXTRAL, PRESETS["qwen3-235b-a22b"], PRESETS["demo"]):
        costs = CostSource(spec, cfg)
        for ev in evaluators(spec, H20, L40S, cfg, costs):
            for m in (1, 2, 3, 4):
                for n_a in ev.n_a_candidates(m)[::3]:
                    assert ev.max_b_a(n_a, m) == ev.max_b_a(n_a, m, bisect=True)
                    checked += 1
    assert checked > 100


def test_na_candidates_include_balance_rule() -> None:
    cfg = SearchConfig()
    costs = CostSource(DBRX, cfg)
    ev = next(iter(evaluators(DBRX, A800, A800, cfg, costs)))
    n_star = pm.balance_n_a(ev.k1, ev.exp.k3, ev.n_e, DBRX.top_k)
    cands = ev.n_a_candidates(3)
    assert max(1, math.floor(n_star)) in cands and math.ceil(n_star) in cands


def test_heterogeneous_dbrx_prefers_h20_attention_l40s_experts() -> None:
    # the paper's §4.3 pairing, reproduced by the roofline model for DBRX
    (cmp,) = compare_hetero([DBRX], [H20, L40S, A800])
    assert cmp.best_hetero is not None and cmp.best_homogeneous is not None
    assert (cmp.best_hetero.attention_gpu, cmp.best_hetero.expert_gpu) == ("H20", "L40S")
    assert cmp.gain is not None and cmp.gain > 1.0


def test_require_overlap_filters() -> None:
    res = search(DBRX, [H20], [L40S], SearchConfig(require_overlap=True, tp_choices=(1, 2)))
    assert res.plans and all(p.comm_hidden and p.pipeline_full for p in res.plans)


def test_unpriced_gpus_rank_by_gpu() -> None:
    h100 = BUILTIN_GPUS["H100"]
    res = search(PRESETS["demo"], [h100], config=SearchConfig(tp_choices=(1,)))
    assert res.objective == "gpu" and res.notes
    assert res.plans[0].throughput_per_cost is None
    with pytest.raises(ConfigError, match="price"):
        search(PRESETS["demo"], [h100], config=SearchConfig(objective="cost"))
    cat = load_catalog().with_updates({"H100": {"price": 4.0}})
    assert search(PRESETS["demo"], [cat.get("H100")], config=SearchConfig(tp_choices=(1,))).objective == "cost"


def test_watt_objective() -> None:
    res = search(PRESETS["demo"], [H20, L40S], [H20, L40S], SearchConfig(objective="watt", tp_choices=(1, 2)))
    vals = [p.throughput_per_watt for p in res.plans]
    assert vals == sorted(vals, reverse=True)


def test_profile_restricts_search_and_is_used() -> None:
    prof = Profile(
        model="dbrx",
        attention=(AttentionCost(1e-6, 1e-9, 2e-4, tp=2, gpu="H20"),),
        expert=(ExpertCost(1e-6, 3e-4, tp=1, experts_per_node=1, gpu="L40S"),),
        network=NetworkProfile(latency_s=20e-6, bandwidth_Bps=10e9, nominal_Bps=12.5e9),
    )
    res = search(DBRX, [H20], [L40S], SearchConfig(), prof)
    assert res.plans and not res.estimate
    assert {(p.tp_a, p.tp_e, p.experts_per_node, p.source) for p in res.plans} == {(2, 1, 1, "profile")}
    p = res.plans[0]
    assert p.ta_s == pytest.approx(prof.attention[0].time(p.b_a, 650))
    assert p.te_s == pytest.approx(prof.expert[0].time(p.b_e))
    # fallback fills the rest with the roofline
    res2 = search(DBRX, [H20], [L40S], SearchConfig(allow_roofline_fallback=True, tp_choices=(1, 2)), prof)
    assert {p.source for p in res2.plans} >= {"profile", "roofline-estimate"}
    with pytest.raises(ConfigError, match="covers none"):
        search(DBRX, [A800], None, SearchConfig(), prof)


def test_infeasible_when_weights_do_not_fit() -> None:
    tiny = load_catalog().with_updates(
        {
            "Tiny": {
                "memory_gb": 1,
                "mem_bw_gbs": 100,
                "tflops": 10,
                "power_w": 50,
                "net_gbps": 10,
                "intra_node_gbs": 10,
                "price": 0.1,
            }
        }
    )
    res = search(MIXTRAL, [tiny.get("Tiny")])
    assert res.plans == [] and res.notes


def test_sweep_shape() -> None:
    res = search(PRESETS["demo"], [H20], config=SearchConfig(tp_choices=(1,)))
    data = sweep(PRESETS["demo"], res.plans[0], H20, H20, SearchConfig(tp_choices=(1,)), n_a_values=[1, 2, 3])
    assert set(data) == {1, 2, 3, 4} and all(len(v) == 3 for v in data.values())


def test_plan_json_keys(mixtral_a800) -> None:  # type: ignore[no-untyped-def]
    d = mixtral_a800.plans[0].to_json()
    assert list(d)[:13] == [
        "attention_gpu",
        "expert_gpu",
        "tp_a",
        "tp_e",
        "n_a",
        "n_e",
        "micro_batches",
        "batch",
        "tbt_ms",
        "throughput_tok_s",
        "throughput_per_gpu",
        "throughput_per_cost",
        "throughput_per_watt",
    ]
    assert d["tbt_ms"] == pytest.approx(mixtral_a800.plans[0].tbt_s * 1e3)
