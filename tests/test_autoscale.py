"""``serve --autoscale`` live: a step load (idle -> a burst that misses the TPOT SLO at the starting
size -> idle) grows the attention pool and shrinks it back; no request fails and the greedy tokens
are a fixed deployment's. Set AFDSERVE_AUTOSCALE_TIMELINE=PATH to keep the run's timeline (JSON
lines: every sample's signals, decision and pool sizes)."""

import os
import shutil
import threading

import httpx
import pytest

from afdserve import LLM, SamplingParams
from afdserve.bench.soak import scrape
from afdserve.config import EngineConfig
from afdserve.errors import ConfigError
from afdserve.planner import AttentionCost, ExpertCost, Profile, save_profile
from afdserve.planner.autoscale import AutoscaleConfig
from afdserve.serving.server import BackgroundServer, ServerOptions, build_app

from polling import alive, wait_until

DEPLOYMENT = dict(num_kv_blocks=64, attention_workers=1, expert_workers=1, micro_batches=2)
# 1 ms per output token: the tiny model on 2 CPU cores misses it at any batch, so a burst is over the SLO
POLICY = AutoscaleConfig.from_bounds((1, 2), (1, 1), slo_tpot_s=0.001, window_s=0.5, cooldown_s=1.0)
MAX_TOKENS = 24


def _prompt(i: int) -> list[int]:
    return [3 + i % 50, 7 + i % 13, 11, 5 + i % 7]


def test_bad_autoscaling_options_are_refused_before_workers_start(tiny_mixtral, tmp_path):
    with pytest.raises(ConfigError, match="outside its autoscaling sizes"):
        build_app(EngineConfig(model=str(tiny_mixtral), **{**DEPLOYMENT, "attention_workers": 3}),
                  ServerOptions(autoscale=POLICY))
    with pytest.raises(ConfigError, match="disaggregated"):
        build_app(EngineConfig(model=str(tiny_mixtral), num_kv_blocks=64, expert_workers=0),
                  ServerOptions(autoscale=POLICY))
    with pytest.raises(ConfigError, match="expert workers"):
        build_app(EngineConfig(model=str(tiny_mixtral), **DEPLOYMENT),
                  ServerOptions(autoscale=AutoscaleConfig.from_bounds((1, 2), (1, 99), slo_tpot_s=0.1)))
    # the planner's local model needs a measured profile: one without runtime costs is refused
    profile = tmp_path / "roofline.json"
    save_profile(Profile(model="tiny", attention=(AttentionCost(1e-6, 0.0, 1e-4),),
                         expert=(ExpertCost(1e-6, 1e-4, experts_per_node=1),)), profile)
    for path, why in ((profile, "runtime costs"), (tmp_path / "missing.json", "cannot read profile")):
        with pytest.raises(ConfigError, match=why):
            build_app(EngineConfig(model=str(tiny_mixtral), **DEPLOYMENT),
                      ServerOptions(autoscale=POLICY, autoscale_profile=str(path)))


def test_step_load_grows_a_pool_and_shrinks_it_back(tiny_mixtral, tmp_path):
    timeline = tmp_path / "timeline.jsonl"
    app = build_app(EngineConfig(model=str(tiny_mixtral), **DEPLOYMENT),
                    ServerOptions(served_model_name="tiny", autoscale=POLICY, autoscale_interval_s=0.2,
                                  autoscale_timeline=str(timeline)))
    scaler, cluster = app.state.autoscaler, app.state.engine.engine
    got: dict[int, list[int]] = {}
    errors: list[str] = []
    grown = threading.Event()
    try:
        with BackgroundServer(app) as url:
            # idle: nothing to do at the minimum
            assert wait_until(lambda: len(scaler.timeline) >= 3, 30), "the autoscaler does not sample"
            assert {(e["action"], e["reason"]) for e in scaler.timeline} == {("hold", "at_min")}

            def client(k: int) -> None:  # requests until the pool grew, then 3 more (on the grown pool)
                i, after = k, 0
                with httpx.Client(base_url=url, timeout=120) as c:
                    while after < 3:
                        after += grown.is_set()
                        r = c.post("/v1/completions", json={
                            "model": "tiny", "prompt": _prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, "return_token_ids": True})
                        if r.status_code != 200:
                            errors.append(f"{r.status_code} {r.text}")
                            return
                        got[i] = r.json()["choices"][0]["token_ids"]
                        i += 4

            threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            ok = wait_until(lambda: len(cluster.attention) == 2 or errors, 90)
            pids = {w.pid for w in cluster.workers.values()}
            grown.set()
            for t in threads:
                t.join(120)
            assert ok and not errors, errors or "the attention pool did not grow under the burst"
            # idle again: back to the starting size
            assert wait_until(lambda: len(cluster.attention) == 1, 60), "the attention pool did not shrink back"
            assert wait_until(lambda: scrape(url).get("afdserve_autoscale_pool_workers{pool=attention}") == 1.0, 10)
            m = scrape(url)
    finally:
        if os.environ.get("AFDSERVE_AUTOSCALE_TIMELINE") and timeline.exists():
            shutil.copy(timeline, os.environ["AFDSERVE_AUTOSCALE_TIMELINE"])
    assert wait_until(lambda: not any(alive(p) for p in pids), 30), "worker processes outlived the server"
    ups = m.get("afdserve_autoscale_decisions_total{action=up,pool=attention,reason=tpot_over_slo}", 0)
    downs = m.get("afdserve_autoscale_decisions_total{action=down,pool=attention,reason=underused}", 0)
    assert ups == 1 and downs == 1, {k: v for k, v in m.items() if "autoscale" in k}
    assert m.get("afdserve_autoscale_resize_failures_total", 0) == 0
    assert m["afdserve_autoscale_last_resize_timestamp_seconds"] > 0
    assert m.get("afdserve_request_finish_total{reason=error}", 0) == 0
    kinds = [(e.get("action"), e.get("reason")) for e in scaler.timeline]
    assert kinds.index(("up", "tpot_over_slo")) < kinds.index(("down", "underused"))
    # the same prompts on a fixed deployment: the same greedy tokens
    ids = sorted(got)
    with LLM(str(tiny_mixtral), **DEPLOYMENT) as llm:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": _prompt(i)} for i in ids], params)]
    assert [got[i] for i in ids] == want
