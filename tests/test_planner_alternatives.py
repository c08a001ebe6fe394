"""The colocated families (DP attention + wide EP, TP x PP), the verdict that compares them with AFD,
the catalog's cases and the published findings: hand-checkable formulas, pure computation."""

import json
from dataclasses import replace

import pytest

from afdserve.cli.plan import main as plan_main
from afdserve.errors import ConfigError
from afdserve.planner import SearchConfig, load_model_spec
from afdserve.planner import roofline
from afdserve.planner.alternatives import (
    AltConfig,
    FamilyPlan,
    a2a_time,
    buffer_bytes_per_request,
    kv_bytes_per_request,
    tp_plans,
    wide_ep_plans,
)
from afdserve.planner.catalog import BUILTIN_GPUS, GPUSpec
from afdserve.planner.published import CASES, published_findings, run_case
from afdserve.planner.search import evaluate
from afdserve.planner.verdict import compare_families, reason

MIXTRAL = load_model_spec("mixtral-8x22b")


def test_memory_per_request_by_hand():
    # 650 tokens x 56 layers x (K and V of 8 heads x 128) x 2 bytes
    assert kv_bytes_per_request(MIXTRAL, 650) == 650 * 56 * 2 * 8 * 128 * 2
    # hidden + residual, dispatch and combine buffers (K = 2): 2 bytes x 6144 x (2 + 2*2)
    assert buffer_bytes_per_request(MIXTRAL) == 2 * 6144 * 6


def test_all_to_all_time_by_fabric():
    h800, l40s = BUILTIN_GPUS["H800"], BUILTIN_GPUS["L40S"]
    b = 1e6
    # inside one 8-GPU NVLink domain: 7/8 of the bytes at 200 GB/s per direction
    assert a2a_time(h800, 8, b) == pytest.approx(b * 7 / 8 / 200e9)
    # 16 GPUs: 7/16 over NVLink, 8/16 over the 50 GB/s NIC -- the NIC part binds
    assert a2a_time(h800, 16, b) == pytest.approx(b * 8 / 16 / 50e9)
    # PCIe server: 32 GB/s per direction; a latency adds once
    assert a2a_time(l40s, 8, b, latency_s=1e-5) == pytest.approx(b * 7 / 8 / 32e9 + 1e-5)
    assert a2a_time(h800, 1, b) == 0.0


def test_wide_ep_memory_limited_batch_is_what_fits():
    """A GPU with little memory: the batch is what fits after the weights, and the step is
    L x (Ta + Te + dispatch + combine) with the roofline costs."""
    gpu = replace(BUILTIN_GPUS["H800"], name="small", memory_gb=60)
    cfg = SearchConfig(slo_s=10.0)
    (p,) = wide_ep_plans(MIXTRAL, gpu, cfg, AltConfig(ep_sizes=(8,), tbo=(False,)))
    weights = MIXTRAL.attention_param_bytes + MIXTRAL.expert_node_param_bytes(1)
    per_req = kv_bytes_per_request(MIXTRAL, 650) + buffer_bytes_per_request(MIXTRAL)
    b = int((60e9 - weights) // per_req)
    assert p.limit == "memory" and p.batch == 8 * b and p.num_gpus == 8
    att, exp = roofline.attention_cost(MIXTRAL, gpu, 1), roofline.expert_cost(MIXTRAL, gpu, 1, 1)
    a2a = 2 * a2a_time(gpu, 8, b * 2 * 6144 * 2)
    layer = att.time(b, 650) + exp.time(b * 2) + a2a
    assert p.tbt_s == pytest.approx(56 * layer)
    assert p.throughput_per_gpu == pytest.approx(b / (56 * layer))
    assert p.tokens_per_expert == pytest.approx(8 * b * 2 / 8)
    assert sum(p.terms.values()) * p.batch == pytest.approx(p.tbt_s * p.num_gpus)  # GPU-time accounted


def test_slo_limits_the_batch_when_memory_does_not():
    cfg = SearchConfig(slo_s=0.030)
    for p in [*wide_ep_plans(MIXTRAL, BUILTIN_GPUS["H200"], cfg, AltConfig()),
              *tp_plans(MIXTRAL, BUILTIN_GPUS["H200"], cfg, AltConfig())]:
        assert p.tbt_s <= 0.030
        if p.limit == "slo":  # one more request per instance would miss the SLO
            assert p.tbt_s > 0.030 * 0.9


def test_tp_step_by_hand_and_pipeline_stages_make_it_fit():
    gpu = BUILTIN_GPUS["A800"]
    plans = {p.layout: p for p in tp_plans(MIXTRAL, gpu, SearchConfig(), AltConfig(tp_sizes=(4, 8), pp_sizes=(1,)))}
    assert "TP4" in plans and "TP8" in plans
    p = plans["TP8"]
    flat = roofline.RooflineOptions(tp_sync=False)
    att, exp = roofline.attention_cost(MIXTRAL, gpu, 8, flat), roofline.expert_cost(MIXTRAL, gpu, 8, 8, flat)
    ar = 2 * 7 / 8 * 6144 * 2 / 200e9
    b = p.batch
    assert p.tbt_s == pytest.approx(56 * (att.time(b, 650) + exp.time(2 * b) + 2 * ar * b))
    assert p.weights_gb_per_gpu == pytest.approx(MIXTRAL.total_params * 2 / 8 / 1e9)
    # Scaled-MoE's 634 GB of weights leave TP8 on A800s room for a few requests: stages make room
    scaled = load_model_spec("scaled-moe")
    plans = {q.layout: q for q in tp_plans(scaled, gpu, SearchConfig(), AltConfig(tp_sizes=(8,)))}
    assert plans["TP8"].limit == "memory" and plans["TP8"].weights_gb_per_gpu > 79
    assert plans["TP8xPP2"].throughput_per_gpu > 2 * plans["TP8"].throughput_per_gpu
    for q in plans.values():  # every GPU-second of the step is accounted for, stages included
        assert sum(q.terms.values()) * q.batch == pytest.approx(q.tbt_s * q.num_gpus)


def _fp(family, tbt, batch, n, terms, limit="slo", kv_gpus=None, tpe=10.0):
    return FamilyPlan(family, family, "X", n, batch, tbt, batch / tbt, batch / tbt / n, None, 10.0, kv_gpus or n, limit,
                      tpe, "dispatch/combine over RDMA", "", {k: terms.get(k, 0.0) for k in
                                                               ("attention", "expert_weights", "expert_compute",
                                                                "communication", "idle")})


def test_reason_follows_the_numbers():
    w = _fp("afd", 0.1, 1000, 10, {"attention": 1e-4, "expert_weights": 1e-5})
    # the loser streams expert weights for few tokens
    lw = _fp("wide-ep", 0.1, 500, 10, {"attention": 1e-4, "expert_weights": 1.1e-4}, tpe=3)
    assert "too few tokens per expert" in reason(w, lw, "gpu")
    assert reason(w, lw, "gpu").startswith("afd 2.00x over wide-ep")
    # its all-to-all dominates
    lc = _fp("wide-ep", 0.1, 500, 10, {"attention": 1e-4, "expert_weights": 1e-5, "communication": 1e-4})
    assert "bandwidth-bound dispatch/combine over RDMA" in reason(w, lc, "gpu")
    # memory-bound with fewer resident requests per GPU, same step time: the batch explains the gain
    lm = _fp("wide-ep", 0.1, 600, 10, {"attention": 1e-4, "expert_weights": 7e-5}, limit="memory")
    assert "memory-limited batch" in reason(w, lm, "gpu")
    assert "only family" in reason(w, None, "gpu")


def test_catalog_cases_pick_wide_ep_somewhere_and_afd_somewhere():
    by_name = {c.name: c for c in CASES}
    ep = run_case(by_name["h800-deepseek-v3"])
    afd = run_case(by_name["h20-l40s-scaled-moe"])
    assert ep.winner.family == "wide-ep" and "A2E/E2A" in ep.reason
    assert afd.winner.family == "afd"
    tight = run_case(by_name["h800-mixtral-50ms"])  # small batches: colocated experts see few tokens
    assert tight.winner.family == "afd" and "too few tokens per expert" in tight.reason
    for c in (ep, afd):
        values = [p.objective_value(c.objective) for p in c.best]
        assert values == sorted(values, reverse=True) and {p.family for p in c.best} == {"afd", "wide-ep", "tp"}
        assert c.reason.startswith(f"{c.winner.family} {c.gain(c.winner.family, c.best[1].family):.2f}x over")
        for p in c.best:  # the terms account for every GPU-second of the step
            assert sum(p.terms.values()) * p.batch == pytest.approx(p.tbt_s * p.num_gpus)
            assert min(p.terms.values()) >= -1e-12


def test_afd_talks_over_nvlink_inside_one_domain():
    spec, g = load_model_spec("qwen3-235b-a22b"), BUILTIN_GPUS["GB200"]
    p = evaluate(spec, g, g, tp_a=1, tp_e=1, n_a=4, micro_batches=2, experts_per_node=32, b_a=64)
    r = replace(g, nvlink_domain=1)
    q = evaluate(spec, r, r, tp_a=1, tp_e=1, n_a=4, micro_batches=2, experts_per_node=32,
                 b_a=64)
    # same bytes; NVLink (900 GB/s per direction) against a 400 Gb/s NIC
    assert q.tc_s / p.tc_s == pytest.approx(900e9 / 50e9)


def test_gb200_per_gpu_from_the_nvl72_totals():
    g = BUILTIN_GPUS["GB200"]
    assert g.memory_gb == pytest.approx(13.4e3 / 72, rel=0.01)
    assert g.mem_bw_gbs == pytest.approx(576e3 / 72)
    assert g.tflops == pytest.approx(360e3 / 72 / 2)  # BF16 with sparsity / 2 = dense
    assert g.nvlink_domain == 72


def test_published_findings_are_reproduced_or_name_what_is_missing():
    found = published_findings()
    assert len(found) == 6
    for f in found:
        assert f.reproduced or f.missing not in ("", "-"), f.name
    fast = next(f for f in found if f.name.startswith("FastAFD"))
    ratio = float(fast.detail.split("x resident")[0])
    assert 1.4 <= ratio <= 1.6  # the gain comes from resident requests (FastAFD: ~1.5x)
    dead = next(f for f in found if "dead zone" in f.name)
    assert dead.planner < 1.0 and dead.reproduced


def test_bad_input_is_refused():
    with pytest.raises(ConfigError):
        AltConfig(families=("afd", "pp"))
    with pytest.raises(ConfigError):
        wide_ep_plans(MIXTRAL, BUILTIN_GPUS["A800"], SearchConfig(), AltConfig(ep_sizes=(3,)))
    with pytest.raises(ConfigError):
        compare_families(MIXTRAL, [BUILTIN_GPUS["H100"]], SearchConfig(objective="cost"))
    with pytest.raises(ConfigError):
        GPUSpec("x", 1, 1, 1, 1, 1, 1, nvlink_domain=0)


def test_cli_prints_the_family_table_and_round_trips_json(tmp_path, capsys):
    out = tmp_path / "alt.json"
    assert plan_main(["--model", "deepseek-v3", "--gpus", "H800", "--alternatives", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "layout" in text and "tok/s/GPU" in text and "winner: wide-ep -- " in text
    for fam in ("afd", "wide-ep", "tp"):
        assert f"\n{fam:>7}  " in text
    data = json.loads(out.read_text())["comparisons"][0]
    ref = compare_families(load_model_spec("deepseek-v3"), [BUILTIN_GPUS["H800"]], SearchConfig())
    assert data == json.loads(json.dumps(ref.to_json())) | {k: data[k] for k in ("case", "gpus", "slo_ms", "seq_len")}
    pub = tmp_path / "pub.json"
    assert plan_main(["--published", "--json", str(pub)]) == 0
    assert "| finding | paper | planner | gap |" in capsys.readouterr().out
    rows = json.loads(pub.read_text())["findings"]
    assert [r["planner"] for r in rows] == pytest.approx([f.planner for f in published_findings()])
    assert plan_main(["--alternatives"]) == 2  # no model
    assert plan_main(["--model", "dbrx", "--alternatives", "--profile", str(out)]) == 2
