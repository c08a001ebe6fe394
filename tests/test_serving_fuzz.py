"""Property-based fuzzing of the live server against its own OpenAPI schema (schemathesis): valid
and invalid requests to every operation; no 5xx and no hang (every call has a deadline)."""

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from afdserve.bench.soak import scrape
from afdserve.config import EngineConfig
from afdserve.serving.server import BackgroundServer, ServerOptions, build_app

EXAMPLES = {GenerationMode.POSITIVE: 150, GenerationMode.NEGATIVE: 150}
CALL_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def url(tiny_mixtral):
    # a small context so that most schema-valid max_tokens get a (clean) 400 quickly
    app = build_app(EngineConfig(model=str(tiny_mixtral), num_kv_blocks=64, max_model_len=128),
                    ServerOptions(served_model_name="tiny", max_waiting_requests=8))
    server = BackgroundServer(app)
    yield server.start()
    server.stop()


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
def test_no_server_errors_and_no_hangs(url, mode):
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    session = requests.Session()
    seen: dict[int, int] = {}

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES[mode], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        response = case.call(base_url=url, session=session, timeout=CALL_TIMEOUT_S)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
        if response.status_code >= 400:  # OpenAI-shaped
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}, response.text

    fuzz()
    assert sum(seen.values()) >= EXAMPLES[mode] // 2
    if mode == GenerationMode.POSITIVE:
        assert seen.get(200, 0) >= 10  # a good share of the valid requests generate
    m = scrape(url)
    assert m["afdserve_num_requests_in_flight"] == 0
    assert not any(k.startswith("afdserve_requests_total") and "status=5" in k for k in m), m
