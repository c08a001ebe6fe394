"""The server's edge: admin endpoints off the public API (token or a 127.0.0.1 listener) with bounded
parameters, a body limit, tokenization off the event loop, Unicode and message checks, /health as
the engine's heartbeat and /ready, a shutdown that ends streams with an error and [DONE] and leaves
no process behind, and schemathesis over the whole schema (admin included) with every check."""

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from jsonschema import Draft202012Validator
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)

from afdserve.bench.soak import scrape
from afdserve.cli.main import build_parser
from afdserve.cli.main import main as cli
from afdserve.config import EngineConfig
from afdserve.engine.stats import EngineStats
from afdserve.serving.server import BackgroundServer, ServerOptions, build_app
from polling import wait_until
from tiny_models import make_checkpoint

MODEL = "tiny"
TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HEALTH_TIMEOUT = 1.0  # the served fixture's health_timeout_s
WAIT = 60.0  # bounds the waits for what should happen at once (only a failing test waits this long)


def _app(path, **opts):
    cfg = EngineConfig(model=str(path), num_kv_blocks=64, max_model_len=opts.pop("max_model_len", 512))
    return build_app(cfg, ServerOptions(served_model_name=MODEL, **opts))


@pytest.fixture(scope="module")
def served(tiny_mixtral):
    """A colocated server with an admin token: (url, its AsyncEngine)."""
    app = _app(tiny_mixtral, admin_token=TOKEN, health_timeout_s=HEALTH_TIMEOUT)
    server = BackgroundServer(app)
    yield server.start(), app.state.engine
    server.stop()


@pytest.fixture(scope="module")
def url(served):
    return served[0]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


# ---- admin endpoints ---------------------------------------------------------------------------

def test_admin_endpoints_are_not_served_without_a_token_or_admin_port(tiny_mixtral):
    with BackgroundServer(_app(tiny_mixtral)) as u:
        big = {"planner": "janus", "slots_per_worker": 1140433924}
        assert httpx.post(u + "/admin/rebalance", json=big).status_code == 404
        assert httpx.get(u + "/admin/expert-load", headers=AUTH).status_code == 404
        assert not [p for p in httpx.get(u + "/openapi.json").json()["paths"] if p.startswith("/admin")]


def test_admin_needs_the_token_and_bounds_its_parameters(url):
    big = {"planner": "janus", "slots_per_worker": 1140433924}  # the issue's: ~290 MB/s until OOM
    rss = _rss_mb()
    r = httpx.post(url + "/admin/rebalance", json=big)
    assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
    assert r.json()["error"]["code"] == "missing_admin_token"
    r = httpx.post(url + "/admin/rebalance", json=big, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "invalid_admin_token"
    assert httpx.get(url + "/admin/expert-load", headers={"Authorization": "Basic eDp5"}).status_code == 401
    for slots in (1140433924, 10_000_000, 7, 0, -1, "4", 2.5):  # the model has 6 experts
        r = httpx.post(url + "/admin/rebalance", json={"slots_per_worker": slots}, headers=AUTH, timeout=10)
        assert r.status_code == 400, (slots, r.text)
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_value", "slots_per_worker")
    r = httpx.post(url + "/admin/rebalance", json={"planner": "other"}, headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "planner"
    assert _rss_mb() - rss < 30, "memory grew"
    r = httpx.post(url + "/admin/rebalance", json={"slots_per_worker": 6}, headers=AUTH, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "rebalance_unsupported"  # colocated
    assert httpx.get(url + "/health").status_code == 200
    slots = httpx.get(url + "/openapi.json").json()["components"]["schemas"]["RebalanceRequest"]["properties"]
    assert {"type": "integer", "minimum": 1, "maximum": 6} in slots["slots_per_worker"]["anyOf"]


def test_scale_needs_the_token_and_bounds_its_parameters(url):
    assert httpx.post(url + "/admin/scale", json={"expert_workers": 2}).status_code == 401
    assert httpx.post(url + "/admin/scale", json={"expert_workers": 2},
                      headers={"Authorization": "Bearer wrong"}).status_code == 403
    rss = _rss_mb()
    for param, n in [("expert_workers", 7), ("expert_workers", 1_000_000), ("attention_workers", 65),
                     ("attention_workers", 0), ("expert_workers", -1), ("expert_workers", "2"),
                     ("attention_workers", 2.5)]:  # the model has 6 experts; at most 64 workers a pool
        r = httpx.post(url + "/admin/scale", json={param: n}, headers=AUTH, timeout=10)
        assert r.status_code == 400, (param, n, r.text)
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_value", param)
    assert httpx.post(url + "/admin/scale", json={"workers": 2}, headers=AUTH).status_code == 400
    assert _rss_mb() - rss < 30, "memory grew"
    r = httpx.post(url + "/admin/scale", json={"expert_workers": 2}, headers=AUTH, timeout=30)
    assert r.status_code == 409 and r.json()["error"]["code"] == "scale_unsupported"  # colocated
    props = httpx.get(url + "/openapi.json").json()["components"]["schemas"]["ScaleRequest"]["properties"]
    assert {"type": "integer", "minimum": 1, "maximum": 6} in props["expert_workers"]["anyOf"]
    assert {"type": "integer", "minimum": 1, "maximum": 64} in props["attention_workers"]["anyOf"]


def test_rebalance_cli_sends_the_token(url, capsys, monkeypatch):
    monkeypatch.delenv("AFDSERVE_ADMIN_TOKEN", raising=False)
    assert cli(["rebalance", "--base-url", url]) == 1
    assert "(401)" in capsys.readouterr().out
    assert cli(["rebalance", "--base-url", url, "--admin-token", TOKEN]) == 1
    assert "(409)" in capsys.readouterr().out  # past the token: the colocated engine has no expert workers
    monkeypatch.setenv("AFDSERVE_ADMIN_TOKEN", TOKEN)
    assert cli(["rebalance", "--base-url", url]) == 1
    assert "(409)" in capsys.readouterr().out
    assert cli(["scale", "--base-url", url, "--expert-workers", "2", "--admin-token", "wrong"]) == 1
    assert "(403)" in capsys.readouterr().out
    assert cli(["scale", "--base-url", url, "--expert-workers", "2"]) == 1
    out = capsys.readouterr().out
    assert "scale failed (409)" in out and "no worker pools" in out


def test_admin_port_is_a_separate_listener_on_localhost(tiny_mixtral):
    server = BackgroundServer(_app(tiny_mixtral, admin_port=0))
    with server as u:
        admin = server.admin_url
        assert admin.startswith("http://127.0.0.1:") and admin != u
        assert httpx.get(u + "/admin/expert-load").status_code == 404  # not on the public port
        assert httpx.get(admin + "/admin/expert-load").json()["error"]["code"] == "no_expert_load"
        httpx.post(u + "/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 3}, timeout=30)
        snap = httpx.get(admin + "/admin/expert-load", timeout=30)
        assert snap.status_code == 200 and "tokens" in snap.json()
        assert httpx.post(admin + "/admin/rebalance", json={"slots_per_worker": 99}).status_code == 400
        assert set(httpx.get(admin + "/openapi.json").json()["paths"]) == {"/admin/rebalance", "/admin/scale",
                                                                           "/admin/expert-load"}
        assert httpx.get(admin + "/v1/models").status_code == 404


# ---- request bodies ----------------------------------------------------------------------------

def test_body_limit(url):
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "x" * 8_000_000}, timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(80):
            yield b"x" * 100_000

    r = httpx.post(url + "/tokenize", content=chunked(), headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413
    assert httpx.post(url + "/tokenize", json={"prompt": "still serving"}).status_code == 200
    assert scrape(url)['afdserve_requests_total{endpoint=/v1/completions,status=413}'] >= 1


def test_a_large_prompt_does_not_stall_other_streams(url):
    """A 2 MB prompt (allowed; too long for the context) is tokenized in a worker thread: a stream
    meanwhile keeps getting tokens."""
    big = {"model": MODEL, "prompt": "the quick brown fox jumps over the lazy dog " * 48_000, "max_tokens": 1}
    done = threading.Event()
    result = {}

    def post():
        t0 = time.monotonic()
        result["r"] = httpx.post(url + "/v1/completions", json=big, timeout=60)
        result["s"] = time.monotonic() - t0
        done.set()

    gaps, streams = [], 0
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 400, "stream": True, "ignore_eos": True}
    poster = threading.Thread(target=post)
    while not done.is_set():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            last = None
            for line in r.iter_lines():
                now = time.monotonic()
                if line.startswith("data:"):
                    if last is not None:
                        gaps.append(now - last)
                    last = now
                    if not poster.is_alive() and not done.is_set():
                        poster.start()
        streams += 1
    poster.join()
    assert result["r"].status_code == 400 and result["r"].json()["error"]["code"] == "context_length_exceeded"
    # tokenizing on the event loop would hold every stream back for about as long as the big request
    # took; off the loop, the streams' gaps stay the size of a decode step. So: compare the gaps with
    # the request's measured duration, and that with the gaps' typical size (not fixed constants)
    typical = statistics.median(gaps)
    assert result["s"] > 10 * typical, ("the prompt was tokenized too fast to tell", result["s"], typical)
    assert max(gaps) < result["s"] / 2, (max(gaps), typical, result["s"], streams)


@pytest.mark.parametrize("body,param", [
    ('{"model":"tiny","prompt":"\\ud800"}', "prompt"),
    ('{"model":"\\ud800","prompt":"x"}', "model"),
    ('{"model":"tiny","prompt":["ok","a\\udfffb"]}', "prompt[1]"),
    ('{"model":"tiny","prompt":"x","stop":["\\uDBFF"]}', "stop[0]"),
    ('{"model":"tiny","messages":[{"role":"user","content":"\\ud83d"}]}', "messages[0].content"),
    ('{"model":"tiny","prompt":"x","logit_bias":{"\\ud800":1}}', "logit_bias"),
], ids=["prompt", "model", "batch", "stop", "message", "key"])
def test_lone_surrogates_are_400(url, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_value" and r.json()["error"]["param"] == param, r.text


def test_invalid_utf8_and_the_valid_neighbours(url):
    post = lambda path, raw: httpx.post(url + path, content=raw, headers={"content-type": "application/json"})  # noqa
    for raw in (b'{"prompt":"\xed\xa0\x80"}', b'{"prompt":"\xff"}'):  # a UTF-8-encoded surrogate; not UTF-8
        r = post("/tokenize", raw)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value", r.text
    assert post("/tokenize", b'{"prompt":"\\\\ud800"}').status_code == 200  # a backslash, then text
    assert post("/tokenize", b'{"prompt":"\\ud83d\\ude00 \\\\\\ud83d\\ude00"}').status_code == 200  # pairs
    assert post("/tokenize", '{"prompt":"\U0001f600 ü"}'.encode()).status_code == 200  # UTF-8


def test_error_responses_render_any_string(url):
    from afdserve.serving.errors import ApiError

    assert json.loads(ApiError(400, "bad \ud800 model").response().body)["error"]["message"] == "bad \ud800 model"
    r = httpx.get(url + "/v1/models/%ED%A0%80x")  # not UTF-8 in the path
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(url + "/v1/completions", content=b'"\\\\ud800"', headers={"content-type": "application/json"})
    assert r.json()["error"]["code"] == "invalid_body"  # a string, not an object (an escaped backslash: fine)
    r = httpx.post(url + "/v1/completions", content=b'"\\ud800"', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"


@pytest.mark.parametrize("messages,param", [
    ([{"role": "user"}], "messages[0]"),
    ([{"role": "system", "content": None}, {"role": "user", "content": "x"}], "messages[0]"),
    ([{"role": "user", "content": "x"}, {"role": "assistant"}], "messages[1]"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": []}], "messages[1]"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c1"}], "messages[1]"),
], ids=["user", "system", "assistant", "assistant-no-calls", "tool"])
def test_messages_without_content_are_400(url, messages, param):
    for path in ("/v1/chat/completions", "/tokenize"):
        r = httpx.post(url + path, json={"model": MODEL, "messages": messages})
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("invalid_value", param), r.text


def test_the_schema_says_what_validation_accepts(url):
    schema = httpx.get(url + "/openapi.json").json()
    assert schema["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http", "scheme": "bearer", "description": "the server's admin token (--admin-token or "
                                                          "$AFDSERVE_ADMIN_TOKEN)"}

    def valid(name, body):
        return Draft202012Validator({"$ref": f"#/components/schemas/{name}", **schema}).is_valid(body)

    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    user = {"role": "user", "content": "hi"}
    cases = [  # (schema, body, server accepts)
        ("ChatCompletionRequest", {"model": MODEL, "messages": [{"role": "user"}]}, False),
        ("ChatCompletionRequest", {"model": MODEL, "messages": [user, {"role": "assistant", "tool_calls": [call]},
                                                                 {"role": "tool", "content": "1", "tool_call_id": "c1"},
                                                                 user], "max_tokens": 2}, True),
        ("ChatCompletionRequest", {"model": MODEL, "messages": [user], "top_logprobs": 2}, False),
        ("ChatCompletionRequest", {"model": MODEL, "messages": [user], "top_logprobs": 2, "logprobs": True,
                                   "max_tokens": 2}, True),
        ("ChatCompletionRequest", {"model": MODEL, "messages": [user], "tool_choice": "none"}, False),
        ("CompletionRequest", {"model": MODEL, "prompt": "x", "top_k": 0}, False),
        ("CompletionRequest", {"model": MODEL, "prompt": "x", "top_k": -1, "max_tokens": 2}, True),
        ("CompletionRequest", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, False),
        ("CompletionRequest", {"model": MODEL, "prompt": ""}, False),
        ("CompletionRequest", {"model": MODEL, "prompt": [[1], []]}, False),
        ("CompletionRequest", {"model": MODEL, "prompt": [256]}, False),
        ("CompletionRequest", {"model": MODEL, "prompt": "x", "suffix": "y"}, False),
        ("CompletionRequest", {"model": MODEL, "prompt": "x", "logit_bias": {"256": 1}}, False),
        ("CompletionRequest", {"model": MODEL, "prompt": "x", "logit_bias": {"+5": 1}}, False),
        ("CompletionRequest", {"model": MODEL, "prompt": "x", "logit_bias": {"255": 1}, "max_tokens": 2}, True),
        ("CompletionRequest", {"model": MODEL, "prompt": "x", "stop_token_ids": [256]}, False),
        ("CompletionRequest", {"model": MODEL, "prompt": ["x"] * 5000}, False),  # more than the server takes
    ]
    path = {"ChatCompletionRequest": "/v1/chat/completions", "CompletionRequest": "/v1/completions"}
    for name, body, ok in cases:
        assert valid(name, body) == ok, body
        r = httpx.post(url + path[name], json=body, timeout=30)
        assert (r.status_code == 200) == ok and r.status_code in (200, 400), (body, r.status_code, r.text)


# ---- health, readiness, worker metrics ---------------------------------------------------------

def test_health_is_the_engine_heartbeat(served):
    url, engine = served
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/ready").json() == {"status": "ready", "workers": {}}  # colocated
    release = threading.Event()
    stuck = asyncio.run_coroutine_threadsafe(engine.call(lambda eng: release.wait(WAIT)), engine._loop)
    try:  # the engine thread is stuck until released: /health turns 503 once it is HEALTH_TIMEOUT late
        assert wait_until(lambda: httpx.get(url + "/health").status_code == 503, WAIT, 0.05), "/health stayed 200"
        r = httpx.get(url + "/health")
        assert r.status_code == 503 and "has not turned" in r.json()["error"]["message"], r.text
        assert httpx.get(url + "/ready").status_code == 503
        assert scrape(url)["afdserve_engine_heartbeat_age_seconds"] > HEALTH_TIMEOUT
    finally:
        release.set()
    assert stuck.result(WAIT) is True  # released, not timed out
    assert wait_until(lambda: httpx.get(url + "/health").status_code == 200, WAIT, 0.05), "/health stayed 503"


def test_ready_and_metrics_show_every_worker(served, monkeypatch):
    url, client = served[0], served[1].engine
    stats = EngineStats(workers={"attention0": "up", "expert0": "restarting", "expert1": "up"},
                        restarts={"expert0": 2}, last_failure={"expert0": "killed by signal 9 (SIGKILL)"})
    monkeypatch.setattr(client, "stats", lambda: stats)
    assert wait_until(lambda: served[1].stats().workers == stats.workers, WAIT)  # the engine thread's next snapshot
    r = httpx.get(url + "/ready")
    assert r.status_code == 503 and r.json()["error"]["message"] == "workers not up: expert0 restarting"
    assert httpx.get(url + "/health").status_code == 200  # alive
    m = scrape(url)
    assert m["afdserve_worker_up{worker=expert0}"] == 0 and m["afdserve_worker_up{worker=attention0}"] == 1
    assert m["afdserve_worker_state{state=restarting,worker=expert0}"] == 1
    assert m["afdserve_worker_restarts_total{worker=expert0}"] == 2
    assert m["afdserve_worker_restarts_total{worker=expert1}"] == 0
    assert m["afdserve_worker_last_failure_info{cause=killed by signal 9 (SIGKILL),worker=expert0}"] == 1
    monkeypatch.setattr(client, "stats", lambda: EngineStats(workers={"attention0": "up", "expert0": "up"}))
    assert wait_until(lambda: served[1].stats().workers == {"attention0": "up", "expert0": "up"}, WAIT)
    assert httpx.get(url + "/ready").json() == {"status": "ready", "workers": {"attention0": "up", "expert0": "up"}}


# ---- flags -------------------------------------------------------------------------------------

def test_serve_flags():
    args = build_parser().parse_args(["serve", "--comm-timeout-ms", "500", "--admin-port", "9001", "--admin-token",
                                      "t", "--max-body-bytes", "1048576", "--shutdown-grace", "2"])
    from afdserve.cli.deployment import engine_config

    assert engine_config(args).comm_timeout_ms == 500
    assert (args.admin_port, args.admin_token, args.max_body_bytes, args.shutdown_grace) == (9001, "t", 1048576, 2)


# ---- shutdown ----------------------------------------------------------------------------------

def _children(pid: int) -> dict[int, str]:
    """pid -> state of the processes whose parent is ``pid``."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out[int(d)] = fields[0]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_shutdown_ends_streams_with_an_error_and_done_and_reaps_the_workers(tiny_mixtral):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "afdserve.cli.main", "serve", "--model", str(tiny_mixtral),
                             "--served-model-name", MODEL, "--port", str(port), "--log-level", "warning",
                             "--shutdown-grace", "0.3", "--kv-cache-gb", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()
            try:
                if httpx.get(base + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not get ready"
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert len(workers) == 2 and "Z" not in workers.values(), workers  # 1 attention + 1 expert worker
        started = threading.Barrier(4)
        got: dict[int, list[str]] = {}

        def one(i):
            body = {"model": MODEL, "prompt": "hello", "max_tokens": 480, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as r:
                lines = []
                for x in r.iter_lines():
                    if x.startswith("data:"):
                        lines.append(x)
                        if len(lines) == 2:
                            started.wait(30)
                got[i] = lines

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        started.wait(30)
        proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(60)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(got) == [0, 1, 2]
    for lines in got.values():
        assert lines[-1] == "data: [DONE]", lines[-3:]
        error = json.loads(lines[-2][len("data: "):])["error"]
        assert error["code"] == "unavailable" and "shutting down" in error["message"], lines[-2]
        assert 2 <= len(lines) - 2 < 480
    assert proc.returncode in (0, 130), (proc.returncode, err)  # 130: SIGINT, as a shell reports it
    assert "Traceback" not in err and "Exception" not in err, err
    wait_until(lambda: all(_state(p) is None for p in workers), WAIT)
    left = {p: s for p in workers if (s := _state(p)) is not None}
    assert left == {}, f"worker processes left behind: {left}"


def test_a_dead_worker_is_reaped(tiny_mixtral):
    """A worker that dies while serving does not stay a zombie of the server."""
    cfg = EngineConfig(model=str(tiny_mixtral), num_kv_blocks=64, attention_workers=1, expert_workers=1)
    app = build_app(cfg, ServerOptions(served_model_name=MODEL))
    with BackgroundServer(app) as u:
        workers = {name: w.pid for name, w in app.state.engine.engine.workers.items()}
        assert set(workers) == {"attention0", "expert0"}
        os.kill(workers["expert0"], signal.SIGKILL)
        httpx.post(u + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=60)
        deadline = time.monotonic() + 10
        while _state(workers["expert0"]) is not None:
            assert time.monotonic() < deadline, f"expert0 left as {_state(workers['expert0'])}"
            time.sleep(0.1)
        assert "Z" not in _children(os.getpid()).values()


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


# ---- schemathesis over everything --------------------------------------------------------------

#: 400s that a schema-valid request may get: what JSON Schema cannot say (a prompt's token count,
#: comparisons between fields, whether a regex or grammar compiles, what the chat template accepts,
#: the server's tool-calling setup)
SEMANTIC = {"context_length_exceeded": None, "invalid_messages": None, "unsupported_value": {"best_of", "tool_choice"},
            "unsupported_parameter": {"tools"},
            "invalid_value": {"min_tokens", "tools", "tool_choice", "structured_outputs", "response_format",
                              "guided_json", "guided_regex", "guided_choice", "guided_grammar"}}
EXAMPLES = {GenerationMode.POSITIVE: 200, GenerationMode.NEGATIVE: 200}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def fuzz_url(tmp_path_factory):
    # its tokenizer's ids all fit its vocabulary (tiny_mixtral's tokenizer has 259 tokens for 256 ids)
    path = make_checkpoint(tmp_path_factory.mktemp("mixtral260"), "mixtral", vocab_size=260)
    server = BackgroundServer(_app(path, admin_token=TOKEN, max_model_len=128, max_waiting_requests=8))
    yield server.start()
    server.stop()


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
def test_schemathesis_over_the_whole_schema(fuzz_url, mode):
    url = fuzz_url
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    ops = {op.ok().label for op in schema.get_all_operations()}
    assert {"POST /admin/rebalance", "POST /admin/scale", "GET /admin/expert-load", "POST /v1/completions",
            "GET /ready"} <= ops
    session = requests.Session()
    seen: dict[str, int] = {}

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES[mode], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call(base_url=url, session=session, timeout=20, headers=AUTH)
        key = f"{case.operation.label} {response.status_code}"
        seen[key] = seen.get(key, 0) + 1
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400:
            err = response.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, response.text
        if mode == GenerationMode.POSITIVE and response.status_code == 400:  # positive data accepted
            assert err["code"] in SEMANTIC and (SEMANTIC[err["code"]] is None
                                                or err["param"] in SEMANTIC[err["code"]]), \
                (case.as_curl_command(), response.text)

    fuzz()
    assert sum(seen.values()) >= EXAMPLES[mode] // 2, seen
    if mode == GenerationMode.POSITIVE:
        assert sum(n for k, n in seen.items() if k.endswith(" 200")) >= 20, seen
    m = scrape(url)
    assert m["afdserve_num_requests_in_flight"] == 0
    assert not any(k.startswith("afdserve_requests_total") and "status=5" in k for k in m), m
