"""Async jobs (POST/GET/DELETE /v1/jobs, /events), prefill progress and cached tokens in outputs,
``stream_options.include_progress``, and cancellation that returns a prefill's KV blocks."""

import time

import httpx
import pytest

from afdserve.bench.soak import kv_usage, scrape
from afdserve.bench.sse import named_events
from afdserve.cluster import build_client
from afdserve.config import EngineConfig
from afdserve.engine.sampling_params import SamplingParams
from afdserve.serving.jobs import JobOptions
from afdserve.serving.server import BackgroundServer, ServerOptions, build_app
from tiny_models import make_checkpoint

MODEL = "tiny"
CHUNK = 32  # max_num_batched_tokens: a long prompt prefills in many steps
LONG = 3000


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("mixtral_long"), "mixtral", max_position_embeddings=4096)


def _cfg(path, **over):
    return EngineConfig(model=str(path), num_kv_blocks=256, max_num_batched_tokens=CHUNK, max_model_len=4096,
                        **over)


@pytest.fixture(scope="module")
def server(long_model):
    app = build_app(_cfg(long_model), ServerOptions(served_model_name=MODEL, job_ttl_s=60, max_jobs=64))
    srv = BackgroundServer(app)
    url = srv.start()
    yield url, app.state.jobs
    srv.stop()


def _prompt(n, seed=0):
    return [(seed * 7919 + i * 31) % 250 + 3 for i in range(n)]


def _wait(url, job_id, status=("succeeded", "failed", "cancelled"), timeout=120.0):
    """Polls a job until it ends; returns every view seen."""
    views = []
    deadline = time.monotonic() + timeout
    while True:
        v = httpx.get(f"{url}/v1/jobs/{job_id}").json()
        views.append(v)
        if v["status"] in status:
            return views
        assert time.monotonic() < deadline, v
        time.sleep(0.01)


def _wait_idle(url, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if m["afdserve_num_requests_in_flight"] == 0 and not any(kv_usage(m).values()):
            return m
        assert time.monotonic() < deadline, kv_usage(m)
        time.sleep(0.02)


def test_engine_reports_prefill_progress_and_frees_blocks_on_abort(long_model):
    client = build_client(_cfg(long_model))
    try:
        total_blocks = client.engine.blocks.num_free
        rid = client.add_request({"prompt_token_ids": _prompt(LONG)}, SamplingParams(max_tokens=4))
        seen = []
        for _ in range(5):
            outs = client.get_outputs()
            assert [o.request_id for o in outs] == [rid] and not outs[0].outputs[0].token_ids
            seen.append(outs[0].prefill)
        assert [p.done for p in seen] == [CHUNK * (i + 1) for i in range(5)]
        assert all(p.total == LONG for p in seen)
        assert outs[0].num_cached_tokens == 0
        client.abort(rid)
        assert client.get_outputs() == []
        assert not client.engine.has_unfinished() and client.engine.blocks.num_free == total_blocks
    finally:
        client.shutdown()


def test_job_progress_result_and_usage(server):
    url, _ = server
    body = {"model": MODEL, "prompt": _prompt(600), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] in ("queued", "running") and job["object"] == "job" and job["result"] is None
    assert job["progress"]["prompt_tokens_total"] == 600
    views = _wait(url, job["id"])
    done = [v["progress"]["prompt_tokens_done"] for v in views]
    assert done == sorted(done) and done[-1] == 600
    final = views[-1]
    assert final["status"] == "succeeded" and final["progress"]["eta_seconds"] == 0
    assert final["expires_in_s"] is not None and 0 < final["expires_in_s"] <= 60
    want = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    got = final["result"]
    assert got["object"] == "text_completion" and got["choices"] == want["choices"]
    assert got["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # the first time: a cold prefill
    assert want["usage"]["prompt_tokens_details"]["cached_tokens"] == (600 - 1) // 16 * 16  # its full blocks, cached
    assert {k: v for k, v in got["usage"].items() if k != "prompt_tokens_details"} == \
        {k: v for k, v in want["usage"].items() if k != "prompt_tokens_details"}


def test_chat_job_and_events(server):
    url, _ = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello world " * 60}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "logit_bias": {"74": 100}}  # "h", every time
    job = httpx.post(url + "/v1/jobs", json=body).json()
    with httpx.stream("GET", f"{url}/v1/jobs/{job['id']}/events", timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = list(named_events(resp.iter_lines()))
    kinds = [k for k, _ in events]
    assert kinds[-1] == "end" and "progress" in kinds and "output" in kinds, events
    done = [d["prompt_tokens_done"] for k, d in events if k == "progress"]
    assert done == sorted(done)
    end = events[-1][1]
    assert end["status"] == "succeeded" and end["endpoint"] == "/v1/chat/completions"
    text = "".join(c["text"] for k, d in events if k == "output" for c in d["choices"])
    assert text == end["result"]["choices"][0]["message"]["content"]
    want = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    assert end["result"]["choices"] == want["choices"]


def test_cancel_mid_prefill_returns_blocks(server):
    url, _ = server
    _wait_idle(url)
    body = {"model": MODEL, "prompt": _prompt(LONG, seed=1), "max_tokens": 4}
    job = httpx.post(url + "/v1/jobs", json=body).json()
    with httpx.stream("GET", f"{url}/v1/jobs/{job['id']}/events", timeout=60) as resp:
        for kind, data in named_events(resp.iter_lines()):
            if kind == "progress" and data["prompt_tokens_done"] > 0:
                assert data["prompt_tokens_done"] < LONG
                m = scrape(url)
                assert any(kv_usage(m).values())  # its blocks are taken
                r = httpx.delete(f"{url}/v1/jobs/{job['id']}")
                assert r.status_code == 200 and r.json()["status"] == "cancelled"
                break
    v = _wait(url, job["id"])[-1]
    assert v["status"] == "cancelled" and v["result"] is None
    assert v["progress"]["prompt_tokens_done"] < LONG
    _wait_idle(url)  # every block back in the pool, nothing in flight
    assert httpx.delete(f"{url}/v1/jobs/{job['id']}").json()["status"] == "cancelled"  # idempotent


def test_ttl_expiry_with_injected_clock(server, monkeypatch):
    url, store = server
    now = [1000.0]
    monkeypatch.setattr(store, "clock", lambda: now[0])
    job = httpx.post(url + "/v1/jobs", json={"model": MODEL, "prompt": "hello", "max_tokens": 2}).json()
    v = _wait(url, job["id"])[-1]
    assert v["status"] == "succeeded" and v["expires_in_s"] == 60
    now[0] += 59.5
    assert httpx.get(f"{url}/v1/jobs/{job['id']}").json()["expires_in_s"] == 0.5
    now[0] += 0.5
    r = httpx.get(f"{url}/v1/jobs/{job['id']}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"


def test_job_bound_429(server, monkeypatch):
    url, store = server
    monkeypatch.setattr(store, "options", JobOptions(ttl_s=60, max_jobs=len(store.jobs) + 1))
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    assert httpx.post(url + "/v1/jobs", json=body).status_code == 202
    r = httpx.post(url + "/v1/jobs", json=body)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "too_many_jobs"


def test_unknown_jobs_404_and_bad_bodies_400(server):
    url, _ = server
    for method, path in (("GET", "/v1/jobs/job-nope"), ("GET", "/v1/jobs/job-nope/events"),
                         ("DELETE", "/v1/jobs/job-nope")):
        r = httpx.request(method, url + path)
        assert r.status_code == 404, (method, path)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    bad = [{"model": MODEL, "prompt": "hi", "stream": True},
           {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
           {"model": "other", "prompt": "hi"},
           {"model": MODEL},
           {"model": MODEL, "prompt": "hi", "messages": [{"role": "user", "content": "x"}]},
           {"model": MODEL, "messages": []},
           {"model": MODEL, "prompt": "hi", "max_tokens": 10**6}]
    for body in bad:
        r = httpx.post(url + "/v1/jobs", json=body)
        assert r.status_code == 400, (body, r.text)
    schema = httpx.get(url + "/openapi.json").json()
    job_body = schema["paths"]["/v1/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert job_body["properties"]["stream"] == {"enum": [False, None]}


def test_stream_include_progress(server):
    url, _ = server
    body = {"model": MODEL, "prompt": _prompt(400, seed=2), "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    full = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", timeout=60,
                      json=body | {"stream": True, "stream_options": {"include_progress": True,
                                                                      "include_usage": True}}) as resp:
        chunks = [d for _, d in named_events(resp.iter_lines())]
    progress = [c["progress"] for c in chunks if "progress" in c]
    done = [p["prompt_tokens_done"] for p in progress]
    assert done and done == sorted(done) and done[-1] == 400
    assert all(p["prompt_tokens_total"] == 400 for p in progress)
    assert all(c["choices"] == [] for c in chunks if "progress" in c)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full["choices"][0]["text"]
    assert full["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # the same prompt again: its full blocks are cached, up to the last token (computed for its logits)
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": (400 - 1) // 16 * 16}
    assert progress[-1]["cached_tokens"] == (400 - 1) // 16 * 16
    # without the option: no progress chunks
    with httpx.stream("POST", url + "/v1/completions", timeout=60, json=body | {"stream": True}) as resp:
        assert not any("progress" in d for _, d in named_events(resp.iter_lines()))


def test_prefix_cache_metrics(server):
    url, _ = server
    body = {"model": MODEL, "prompt": _prompt(200, seed=3), "max_tokens": 2}
    for _ in range(2):
        assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    deadline = time.monotonic() + 10
    while True:  # the figures are read at each stats refresh (every second)
        m = scrape(url)
        if m.get('afdserve_prefix_cache_tier_hit_tokens_total{tier=device,worker=engine}', 0) >= 192:
            break
        assert time.monotonic() < deadline, {k: v for k, v in m.items() if "prefix" in k}
        time.sleep(0.1)
    assert 0 < m["afdserve_prefix_cache_hit_rate{worker=engine}"] < 1
    hits, queries = (m[f"afdserve_prefix_cache_{k}_total{{worker=engine}}"] for k in ("hits", "queries"))
    assert 0 < hits <= queries
    assert m["afdserve_prefix_cache_requests_total{result=hit,worker=engine}"] >= 1
    for key in ("afdserve_prefix_cache_host_disk_blocks_total{action=restored,worker=engine}",
                "afdserve_prefix_cache_evictions_total{tier=device,worker=engine}",
                "afdserve_prefix_cache_usage{tier=device,worker=engine}",
                "afdserve_prefix_cache_limit{tier=host,worker=engine}"):
        assert key in m, key
