"""/tokenize, /detokenize, /version and /v1/models/{id} (as vLLM serves them), the process title of
a worker, and schemathesis over these endpoints: no server error, every response as the schema says,
and validation that matches the schema both ways (valid data accepted, invalid data rejected)."""

import json
import subprocess
import sys
from importlib.metadata import version

import httpx
import openai
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 positive_data_acceptance, response_schema_conformance, status_code_conformance)

from afdserve.config import EngineConfig
from afdserve.serving.server import BackgroundServer, ServerOptions, build_app

MODEL = "tiny"
NEW_PATHS = ("/tokenize", "/detokenize", "/version", "/v1/models/{model_id}")


@pytest.fixture(scope="module")
def url(tiny_tool_model):
    app = build_app(EngineConfig(model=str(tiny_tool_model), num_kv_blocks=64, max_model_len=512),
                    ServerOptions(served_model_name=MODEL))
    server = BackgroundServer(app)
    yield server.start()
    server.stop()


def _post(url, path, body):
    return httpx.post(url + path, json=body, timeout=30)


@pytest.mark.parametrize("prompt", ["hello world", "the quick brown fox 0123456789 ünïcode ✓", " x  y\n"])
def test_tokenize_detokenize_round_trip(url, prompt):
    plain = _post(url, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    assert plain["count"] == len(plain["tokens"]) > 0 and plain["max_model_len"] == 512
    assert _post(url, "/detokenize", {"tokens": plain["tokens"]}).json() == {"prompt": prompt}
    strs = _post(url, "/tokenize", {"model": MODEL, "prompt": prompt, "return_token_strs": True}).json()
    assert len(strs["token_strs"]) == strs["count"] and all(isinstance(x, str) for x in strs["token_strs"])
    with_bos = [1] + plain["tokens"]
    text = _post(url, "/detokenize", {"model": MODEL, "tokens": with_bos}).json()["prompt"]
    assert text == "<s>" + prompt  # special tokens included: ids -> text -> ids round-trips
    assert _post(url, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"] == with_bos


def test_tokenize_matches_the_completion_and_chat_prompts(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=1)
    assert _post(url, "/tokenize", {"prompt": "hello world"}).json()["count"] == r.usage.prompt_tokens
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    chat = _post(url, "/tokenize", {"messages": msgs}).json()
    assert chat["count"] == r.usage.prompt_tokens
    prompt = _post(url, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert prompt == "<|system|>be brief\n<|user|>hello\n<|assistant|>"
    no_gen = _post(url, "/tokenize", {"messages": msgs, "add_generation_prompt": False}).json()
    assert no_gen["tokens"] == chat["tokens"][:no_gen["count"]] and no_gen["count"] < chat["count"]


BAD = [
    ("/tokenize", {}, "missing_required_parameter", "prompt"),
    ("/tokenize", {"prompt": 5}, "invalid_value", "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model_not_found", "model"),
    ("/tokenize", {"prompt": "x", "bogus": 1}, "unknown_parameter", "bogus"),
    ("/tokenize", {"messages": []}, "invalid_value", "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "invalid_value", "messages[0].role"),
    ("/detokenize", {"tokens": [1, 256]}, "invalid_value", "tokens"),
    ("/detokenize", {"tokens": [-1]}, "invalid_value", "tokens[0]"),
    ("/detokenize", {"tokens": ["a"]}, "invalid_value", "tokens[0]"),
    ("/detokenize", {"tokens": [1], "model": "other"}, "model_not_found", "model"),
]


@pytest.mark.parametrize("path,body,code,param", BAD, ids=[f"{i}-{b[0]}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_400(url, path, body, code, param):
    r = _post(url, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert (err["code"], err["param"]) == (code, param), err


def test_version_and_model_card(url):
    assert httpx.get(url + "/version").json() == {"version": version("afdserve")}
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.model_extra["max_model_len"] == 512
    assert card == client.models.list().data[0]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("org/other-model")
    r = httpx.get(url + "/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_model_ids_with_slashes(tiny_mixtral):
    app = build_app(EngineConfig(model=str(tiny_mixtral), num_kv_blocks=32), ServerOptions(served_model_name="org/m"))
    with BackgroundServer(app) as u:
        assert openai.OpenAI(base_url=u + "/v1", api_key="x", max_retries=0).models.retrieve("org/m").id == "org/m"
        assert httpx.get(u + "/v1/models/org/m").json()["id"] == "org/m"


def test_openapi_schema_of_the_new_endpoints(url):
    schema = httpx.get(url + "/openapi.json").json()
    for path in NEW_PATHS:
        assert path in schema["paths"], path
    body = schema["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert [s["$ref"].rsplit("/", 1)[1] for s in body["oneOf"]] == ["TokenizeCompletionRequest", "TokenizeChatRequest"]
    detok = schema["components"]["schemas"]["DetokenizeRequest"]["properties"]
    assert detok["tokens"]["items"]["maximum"] == 255  # the vocabulary, as validated
    assert {"type": "string", "enum": [MODEL]} in detok["model"]["anyOf"]


EXAMPLES = {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 60}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          positive_data_acceptance, negative_data_rejection]


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
def test_schemathesis_over_the_new_endpoints(url, mode):
    schema = schemathesis.openapi.from_url(url + "/openapi.json").include(
        path_regex="^/(tokenize|detokenize|version|v1/models/)")
    assert {op.ok().path for op in schema.get_all_operations()} == set(NEW_PATHS)
    session = requests.Session()
    seen: dict[str, int] = {}

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES[mode], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call(base_url=url, session=session, timeout=20)
        key = f"{case.operation.path} {response.status_code}"
        seen[key] = seen.get(key, 0) + 1
        case.validate_response(response, checks=CHECKS)
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text

    fuzz()
    assert sum(seen.values()) >= EXAMPLES[mode] // 2, seen
    if mode == GenerationMode.POSITIVE:
        for path in ("/tokenize", "/detokenize", "/version"):
            assert seen.get(f"{path} 200", 0) >= 1, seen


def test_worker_process_title(tiny_mixtral):
    """A worker process carries its role in its title (``ps`` shows ``afdserve: attention0``)."""
    code = ("import setproctitle, afdserve.runtime.worker as w\n"
            "class Config: heartbeat_timeout_ms = 3000\n"
            "class Spec: name = 'attention0'; role = 'attention'; config = Config()\n"
            "class Boom(Exception): pass\n"
            "def fail(spec): raise Boom(setproctitle.getproctitle())\n"
            "w.AttentionWorker = fail\n"
            "class Ctl:\n"
            "    def send(self, msg): print(msg.error)\n"
            "w.run_worker(Spec(), Ctl())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "Boom: afdserve: attention0" in out.stdout, out.stdout + out.stderr
