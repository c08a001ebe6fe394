"""The OpenAI-compatible server on a colocated tiny model: the official openai client, streaming,
validation, overload, client disconnects, metrics."""

import json
import threading
import time

import httpx
import openai
import pytest

from afdserve import LLM, SamplingParams
from afdserve.bench.soak import kv_usage, scrape
from afdserve.config import EngineConfig
from afdserve.serving.server import BackgroundServer, ServerOptions, build_app

from polling import wait_until

MODEL = "tiny"
ABORTED = "afdserve_request_finish_total{reason=abort}"
WAIT = 60.0  # bounds the waits for what should happen at once (only a failing test waits this long)


def _server(path, opts=None, **cfg):
    cfg = {"num_kv_blocks": 64, **cfg}
    return BackgroundServer(build_app(EngineConfig(model=str(path), **cfg),
                                      opts or ServerOptions(served_model_name=MODEL)))


@pytest.fixture(scope="module")
def url(tiny_mixtral):
    server = _server(tiny_mixtral)
    yield server.start()
    server.stop()


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _wait_idle(url, timeout=5.0):
    """Waits until nothing is in flight and the KV cache is empty; returns the last metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(url)
        if m["afdserve_num_requests_in_flight"] == 0 and not any(kv_usage(m).values()):
            return m
        assert time.monotonic() < deadline, f"not idle: {m['afdserve_num_requests_in_flight']} {kv_usage(m)}"
        time.sleep(0.05)


def test_models_and_health(url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_completion_matches_offline_generate(tiny_mixtral, client):
    prompts = ["the quick brown fox", "hello world", "mixture of experts"]
    with LLM(str(tiny_mixtral), num_kv_blocks=64) as llm:
        want = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, w in zip(prompts, want):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})
        c = r.choices[0]
        assert c.text == w.outputs[0].text
        assert c.model_extra["token_ids"] == w.outputs[0].token_ids
        assert c.finish_reason == "length"
        assert r.usage.prompt_tokens == len(w.prompt_token_ids) and r.usage.completion_tokens == 12
        assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_batch_prompts_and_token_prompt(client):
    r = client.completions.create(model=MODEL, prompt=["the quick", "hello"], max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    single = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[1].text == single.choices[0].text
    ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert ids.usage.prompt_tokens == 4
    echo = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0, echo=True,
                                     extra_body={"ignore_eos": True})
    assert echo.choices[0].text == "hello" + single.choices[0].text


def test_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, prompt="attention nodes and", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"


def test_stop_string_streaming_holds_back(client):
    base = client.completions.create(model=MODEL, prompt="the quick brown", max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 6
    stop = base[4:7]  # appears in the greedy output: generation stops before it
    kw = dict(model=MODEL, prompt="the quick brown", max_tokens=24, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0]
    assert full.finish_reason == "stop" and stop not in full.text and base.startswith(full.text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert streamed == full.text


def test_chat_completion_and_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    # no max_tokens: the rest of the context
    long = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_completion_tokens=3)
    assert long.usage.completion_tokens <= 3


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt="hello world", max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
              extra_body={"ignore_eos": True, "top_k": 20})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


BAD = [
    ("/v1/completions", "{not json", "invalid_json", None),
    ("/v1/completions", "[1, 2]", "invalid_body", None),
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, "model_not_found", "model"),
    ("/v1/completions", {"prompt": "hi"}, "missing_required_parameter", "model"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, "invalid_value", "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, "invalid_value", "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 0}, "invalid_value", "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, "invalid_value", "top_p"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "invalid_value", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, "invalid_value", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": True}, "invalid_value", "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2, "best_of": 3}, "unsupported_value", "best_of"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, "invalid_value", "logit_bias"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999": 1}}, "invalid_value", None),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "invalid_value",
     "min_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logprobs": 21}, "invalid_value", "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "guided_regex": "a+", "guided_choice": ["a"]},
     "invalid_value", "guided_choice"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "structured_outputs": {"json": {"type": 5}}},
     "invalid_value", "structured_outputs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "invalid_value", "top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, "invalid_value", "response_format"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 600}, "context_length_exceeded", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream": "yes"}, "invalid_value", "stream"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "bogus": 1}, "unknown_parameter", "bogus"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "invalid_prompt", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [99999]}, "invalid_prompt", "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": [""]}, "invalid_value", "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
     "invalid_value", "stream_options"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "invalid_value", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
     "invalid_value", "messages[0].role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 3000}]},
     "context_length_exceeded", "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 600},
     "context_length_exceeded", "messages"),
]


@pytest.mark.parametrize("path,body,code,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_400(url, path, body, code, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(url + path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["code"] == code and err["param"] == param and err["message"]


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.BadRequestError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


def test_unknown_route_and_method(url):
    r = httpx.get(url + "/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_stream_disconnect_aborts_and_frees_kv(url):
    before = _wait_idle(url).get(ABORTED, 0)
    body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(4)]
        assert any(x.startswith("data:") for x in got)
        assert scrape(url)["afdserve_num_requests_in_flight"] == 1
    m = _wait_idle(url, timeout=WAIT)
    assert m.get(ABORTED, 0) == before + 1  # aborted, not finished after 400 tokens


def test_non_streaming_disconnect_aborts(url):
    before = _wait_idle(url).get(ABORTED, 0)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))  # 500 tokens take longer
    m = _wait_idle(url, timeout=WAIT)
    assert m.get(ABORTED, 0) == before + 1  # aborted, not finished after 500 tokens


def _engine_idle(m: dict[str, float]) -> bool:
    return m["afdserve_num_requests_running"] == m["afdserve_num_requests_waiting"] == 0


def test_slow_reader_does_not_stall_others(url, client):
    """A client that does not read its stream holds no engine step back; its text is intact later."""
    kw = dict(model=MODEL, prompt="ping pong pipeline", max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
    want = client.completions.create(**kw).choices[0].text
    body = {"model": MODEL, "prompt": "ping pong pipeline", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as slow:
        t = time.monotonic()
        quick = client.completions.create(model=MODEL, prompt="hello", max_tokens=8, temperature=0)
        assert quick.choices[0].text is not None and time.monotonic() - t < 5
        # unread, the slow stream still finishes in the engine meanwhile
        assert wait_until(lambda: _engine_idle(scrape(url)), WAIT, 0.05), "the unread stream held the engine back"
        text = "".join(json.loads(x[5:])["choices"][0]["text"] for x in slow.iter_lines()
                       if x.startswith("data:") and "[DONE]" not in x)
    assert text == want


def test_metrics(url, client):
    before = _wait_idle(url)
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    time.sleep(1.2)  # idle wake-ups of the engine thread add nothing
    m = scrape(url)
    # one prefill step of the whole prompt, then one decode step per further token
    assert m["afdserve_micro_batch_tokens_count"] - before["afdserve_micro_batch_tokens_count"] == 5
    assert m["afdserve_micro_batch_tokens_sum"] - before["afdserve_micro_batch_tokens_sum"] == \
        r.usage.prompt_tokens + 4
    text = httpx.get(url + "/metrics").text
    for name in ("afdserve_requests_total", "afdserve_time_to_first_token_seconds_bucket",
                 "afdserve_time_between_tokens_seconds_bucket", "afdserve_e2e_request_latency_seconds_bucket",
                 "afdserve_num_requests_running", "afdserve_num_requests_waiting", "afdserve_kv_cache_usage_ratio",
                 "afdserve_expert_tokens_total", "afdserve_micro_batch_tokens_bucket", "afdserve_worker_busy_ratio",
                 "afdserve_worker_busy_seconds_total"):
        assert name in text, name
    m = scrape(url)
    assert m['afdserve_requests_total{endpoint=/v1/completions,status=200}'] >= 1
    assert m['afdserve_requests_total{endpoint=/v1/completions,status=400}'] >= 1
    assert m["afdserve_time_to_first_token_seconds_count"] >= 1
    assert m["afdserve_time_between_tokens_seconds_count"] >= 4
    # tiny model: 2 layers x 6 experts, top-2: every token of every step counted twice per layer
    experts = {k: v for k, v in m.items() if k.startswith("afdserve_expert_tokens_total")}
    assert len(experts) == 12 and sum(experts.values()) > 0
    assert sum(v for k, v in experts.items() if "layer=0" in k) == sum(v for k, v in experts.items() if "layer=1" in k)
    # the recent window (afdserve.balance): tokens per expert per step and the imbalance per layer
    assert m["afdserve_expert_load_window_steps"] >= 1
    assert m["afdserve_expert_load_imbalance{layer=0}"] >= 1
    assert len([k for k in m if k.startswith("afdserve_expert_tokens_per_step")]) == 12


def test_overload_gets_429_with_retry_after(tiny_mixtral):
    server = _server(tiny_mixtral, ServerOptions(served_model_name=MODEL, max_waiting_requests=1), max_num_seqs=1)
    url = server.start()
    try:
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30), \
                httpx.stream("POST", url + "/v1/completions", json=body, timeout=30):
            r = httpx.post(url + "/v1/completions", json=body | {"stream": False}, timeout=30)
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
            c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.RateLimitError):
                c.completions.create(model=MODEL, prompt="x", max_tokens=2)
        _wait_idle(url)
        assert httpx.post(url + "/v1/completions", json=body | {"stream": False, "max_tokens": 2}).status_code == 200
    finally:
        server.stop()


def test_many_concurrent_clients_complete(url):
    results = []

    def one(i):
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        s = c.completions.create(model=MODEL, prompt=f"hello {i}", max_tokens=16, temperature=0, stream=True,
                                 extra_body={"ignore_eos": True, "return_token_ids": True})
        results.append(sum(len(ch.choices[0].model_extra["token_ids"]) for ch in s if ch.choices))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [16] * 16
    _wait_idle(url)
