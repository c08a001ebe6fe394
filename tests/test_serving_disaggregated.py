"""The server over a disaggregated deployment (1 attention + 2 expert worker processes): greedy
tokens equal offline ``LLM.generate`` on the same deployment; a short soak of 64 streaming clients
leaves nothing behind; a dead worker turns new requests into 503s."""

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from afdserve import LLM, SamplingParams
from afdserve.bench.soak import run_soak, scrape, stray_segments
from afdserve.bench.workload import synthetic_requests
from afdserve.cli.main import main as cli
from afdserve.config import EngineConfig
from afdserve.serving.server import BackgroundServer, ServerOptions, build_app

from polling import alive, wait_until

MODEL = "tiny"
DEPLOYMENT = dict(num_kv_blocks=64, attention_workers=1, expert_workers=2, micro_batches=2)
ADMIN_TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
PROMPTS = ["the quick brown fox", "hello world 0123", "mixture of experts serve", "attention nodes", "ping"]


@pytest.fixture(scope="module")
def deployment(tiny_mixtral):
    app = build_app(EngineConfig(model=str(tiny_mixtral), **DEPLOYMENT),
                    ServerOptions(served_model_name=MODEL, admin_token=ADMIN_TOKEN))
    cluster = app.state.engine.engine
    server = BackgroundServer(app)
    url = server.start()
    yield url, cluster
    server.stop()
    pids = [w.pid for w in cluster.workers.values()]
    wait_until(lambda: not any(alive(p) for p in pids), 60.0)  # the shutdown joins them: at once
    assert not any(alive(p) for p in pids), "worker processes outlived the server"
    assert not stray_segments(set()), "shared-memory segments left behind"


def _live_pids(cluster):
    return {os.getpid()} | {w.pid for w in cluster.workers.values()}


@pytest.mark.torch_backend
def test_greedy_tokens_equal_offline_generate(tiny_mixtral, deployment):
    url, _ = deployment
    with LLM(str(tiny_mixtral), **DEPLOYMENT) as llm:
        want = [o.outputs[0].token_ids for o in
                llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))]
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    got: dict[tuple[str, int], list[int]] = {}

    def one(i, stream):
        kw = dict(model=MODEL, prompt=PROMPTS[i], max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
        if stream:
            ids = []
            for ch in client.completions.create(stream=True, **kw):
                ids += ch.choices[0].model_extra["token_ids"] if ch.choices else []
        else:
            ids = client.completions.create(**kw).choices[0].model_extra["token_ids"]
        got[("s" if stream else "j", i)] = ids

    threads = [threading.Thread(target=one, args=(i, s)) for i in range(len(PROMPTS)) for s in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, w in enumerate(want):
        assert got[("j", i)] == w, i
        assert got[("s", i)] == w, i
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5)
    assert chat.usage.completion_tokens <= 5


def test_rebalance_mid_stream_fails_nothing_and_changes_no_output(tiny_mixtral, deployment):
    url, cluster = deployment
    with LLM(str(tiny_mixtral), **DEPLOYMENT) as llm:
        want = [o.outputs[0].token_ids for o in
                llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))]
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    got: dict[int, list[int]] = {}
    started = threading.Event()

    def one(i):
        ids = []
        for ch in client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=40, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True, "return_token_ids": True}):
            ids += ch.choices[0].model_extra["token_ids"] if ch.choices else []
            started.set()
        got[i] = ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    assert started.wait(60)
    version = cluster.map_version
    r = httpx.post(url + "/admin/rebalance", json={"slots_per_worker": 4}, timeout=120,  # 6 experts, 8 slots
                   headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["version"] == version + 1
    held = r.json()["experts_per_worker"]
    assert sum(len(w[0]) for w in held) == 8  # two replicas in every layer
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(len(PROMPTS))] == want
    snap = httpx.get(url + "/admin/expert-load", timeout=30, headers=ADMIN)
    assert snap.status_code == 200 and "tokens" in snap.json()


def _finished(metrics: dict[str, float]) -> dict[str, float]:
    """Generations ended so far, by reason."""
    return {k.split("=")[1].rstrip("}"): v for k, v in metrics.items() if k.startswith("afdserve_request_finish_total")}


def test_short_soak_64_streaming_clients(deployment):
    url, cluster = deployment
    reqs = synthetic_requests(64, input_len=24, output_len=48, vocab_size=256, seed=1)
    before = _finished(scrape(url))  # the deployment served the module's other tests too
    report = run_soak(url, MODEL, reqs, clients=64, duration_s=20, cancel_fraction=0.15,
                      live_pids=lambda: _live_pids(cluster), drain_timeout_s=10)
    s = report.summary
    assert report.problems == [], report.problems
    assert s["completed"] > 64 and s["cancelled"] > 0 and s["failed"] == 0
    # the workers report their queues with each step, and their counters on the stats request of
    # every refresh (1 s): an expert worker may answer between two layers of a step, so its figures
    # settle once a refresh has come after the last step
    deadline = time.monotonic() + 30
    while True:
        m = scrape(url)
        layer = [sum(v for k, v in m.items() if k.startswith("afdserve_expert_tokens_total") and f"layer={i}" in k)
                 for i in (0, 1)]
        if m["afdserve_num_requests_running"] == m["afdserve_num_requests_waiting"] == 0 and layer[0] == layer[1]:
            break
        assert time.monotonic() < deadline, f"the workers' figures did not settle after the soak: {m}"
        time.sleep(0.2)
    # every request ended exactly once on the server; it aborts only what a client hung up on (a
    # client may hang up on a request that had just finished: that one ends as completed)
    finished = {k: v - before.get(k, 0) for k, v in _finished(m).items()}
    assert sum(finished.values()) == s["completed"] + s["cancelled"]
    assert 0 < finished.get("abort", 0) <= s["cancelled"] and finished.get("error", 0) == 0
    assert {k for k in m if k.startswith("afdserve_worker_busy_ratio")} == {
        "afdserve_worker_busy_ratio{worker=attention0}", "afdserve_worker_busy_ratio{worker=expert0}",
        "afdserve_worker_busy_ratio{worker=expert1}"}
    assert sum(v for k, v in m.items() if k.startswith("afdserve_expert_worker_tokens_total")) > 0
    assert layer[0] == layer[1] > 0  # every token visits top-2 experts in every layer
    assert m["afdserve_expert_load_window_steps"] >= 1  # the workers' recent window (afdserve.balance)
    assert m["afdserve_micro_batch_tokens_count"] > 0


def test_scale_mid_stream_fails_nothing_and_changes_no_output(deployment, capsys):
    """`afdserve scale` adds an attention and an expert worker while 5 streams run; 5 more streams
    start (on the new attention worker); then both are removed again, the removed attention worker's
    streams move: every stream is the fault-free run's, text included. (After the soak: a membership
    change interrupts steps, so the soak's per-layer token totals would no longer match.)"""
    url, cluster = deployment
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    kw = dict(model=MODEL, max_tokens=100, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    want = [(c.model_extra["token_ids"], c.text) for c in
            (client.completions.create(prompt=p, **kw).choices[0] for p in PROMPTS)] * 2
    got: dict[int, tuple[list[int], str]] = {}
    counts = [0] * len(want)
    cond = threading.Condition()

    def one(i):
        ids, text = [], ""
        for ch in client.completions.create(prompt=PROMPTS[i % len(PROMPTS)], stream=True, **kw):
            for c in ch.choices:
                ids += c.model_extra.get("token_ids") or []
                text += c.text
            with cond:
                counts[i] = len(ids)
                cond.notify_all()
        got[i] = (ids, text)

    def start(wave):
        threads = [threading.Thread(target=one, args=(i,)) for i in wave]
        for t in threads:
            t.start()
        with cond:
            assert cond.wait_for(lambda: min(counts[i] for i in wave) >= 10, timeout=120), counts
        return threads

    threads = start(range(len(PROMPTS)))
    assert cli(["scale", "--base-url", url, "--admin-token", ADMIN_TOKEN, "--attention-workers", "2",
                "--expert-workers", "3"]) == 0
    assert "2 attention + 3 expert workers" in capsys.readouterr().out
    threads += start(range(len(PROMPTS), 2 * len(PROMPTS)))
    assert "attention1" in cluster.owner.values()  # streams to move
    r = httpx.post(url + "/admin/scale", json={"attention_workers": 1, "expert_workers": 2}, headers=ADMIN,
                   timeout=300)
    assert r.status_code == 200, r.text
    assert (r.json()["attention_workers"], r.json()["expert_workers"]) == (1, 2)
    for t in threads:
        t.join(120)
    assert [got[i] for i in range(len(want))] == want
    assert sorted(cluster.workers) == ["attention0", "expert0", "expert1"] and cluster.membership.restarts == {}
    assert httpx.get(url + "/ready").status_code == 200


@pytest.mark.parametrize("victim", ["expert0", "attention0"])
def test_streams_continue_through_a_worker_kill(tiny_mixtral, victim):
    app = build_app(EngineConfig(model=str(tiny_mixtral), num_kv_blocks=64, expert_workers=1),
                    ServerOptions(served_model_name=MODEL))
    cluster = app.state.engine.engine
    server = BackgroundServer(app)
    url = server.start()
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        kw = dict(model=MODEL, prompt="hello", max_tokens=300, temperature=0,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
        want = client.completions.create(**kw).choices[0]
        ids, text = [], ""
        for i, chunk in enumerate(client.completions.create(**kw, stream=True)):
            if i == 10:  # mid-stream
                os.kill(cluster.workers[victim].pid, signal.SIGKILL)
            for c in chunk.choices:
                ids += c.model_extra.get("token_ids") or []
                text += c.text
        assert ids == want.model_extra["token_ids"] and text == want.text  # no token lost or repeated
        assert httpx.get(url + "/health").status_code == 200
        assert cluster.membership.restarts == {victim: 1}
        assert client.completions.create(**kw | {"max_tokens": 4}).choices[0].finish_reason == "length"
    finally:
        server.stop()
