"""The serving benchmark's parts (ShareGPT reader, workloads, report) and ``afdserve bench serve``
end to end against a live tiny server; chat templates."""

import json

import pytest

from afdserve.bench.loadgen import RequestResult
from afdserve.bench.serve_report import format_table, summarize
from afdserve.bench.sharegpt import count_records, iter_json_array, load_conversations
from afdserve.bench.workload import sharegpt_requests, synthetic_requests
from afdserve.cli.main import main as afdserve
from afdserve.config import EngineConfig
from afdserve.engine.tokenizer import load_tokenizer
from afdserve.errors import RequestError
from afdserve.model.demo import MIXTRAL_CHAT_TEMPLATE
from afdserve.serving.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from afdserve.serving.server import BackgroundServer, ServerOptions, build_app


def test_json_array_reader_keeps_complete_elements(tmp_path):
    items = [{"id": i, "conversations": [{"from": "human", "value": "x" * (i * 1000)}]} for i in range(50)]
    text = json.dumps(items, indent=2)
    f = tmp_path / "cut.json"
    f.write_text(text[: len(text) - 700])  # cut inside the last element
    assert [x["id"] for x in iter_json_array(f, chunk_chars=4096)] == list(range(49))
    f.write_text(text)
    assert [x["id"] for x in iter_json_array(f, chunk_chars=333)] == list(range(50))


def test_sharegpt_package_recoverable_conversations():
    assert count_records() > 17_000  # ~17.7k complete records before the cut
    convs = load_conversations()
    assert len(convs) > 17_000 and all(c.prompt and c.completion for c in convs[:100])


def test_workloads(tiny_mixtral):
    syn = synthetic_requests(5, 571, 159, vocab_size=256, seed=3)
    assert all(len(r.prompt) == r.prompt_len == 571 and r.output_len == 159 for r in syn)
    assert all(3 <= t < 256 for r in syn for t in r.prompt)
    tok = load_tokenizer(tiny_mixtral).tokenizer
    reqs = sharegpt_requests(tok, 20, seed=0, max_input_len=300, max_output_len=50)
    assert len(reqs) == 20
    assert all(4 <= r.prompt_len <= 300 and 4 <= r.output_len <= 50 for r in reqs)
    assert all(r.prompt_len == len(tok.encode(r.prompt).ids) for r in reqs)


def test_summary_figures():
    rs = [RequestResult(prompt_len=10, output_len=5, start=0.0, ttft=0.1, latency=0.5, gaps=[0.1] * 4, ok=True,
                        status=200, clean=True),
          RequestResult(prompt_len=20, output_len=3, start=1.0, ttft=0.3, latency=0.7, gaps=[0.2, 0.2], ok=True,
                        status=200, clean=True),
          RequestResult(prompt_len=5, status=429, error="HTTP 429: overloaded", clean=True),
          RequestResult(prompt_len=5, output_len=2, cancelled=True, clean=True)]
    s = summarize(rs, duration_s=2.0, slo_tbt_ms=150)
    assert (s["completed"], s["failed"], s["cancelled"]) == (2, 1, 1) and s["errors"] == {"429": 1}
    assert s["request_throughput"] == 1.0 and s["output_token_throughput"] == 4.0
    assert s["total_token_throughput"] == 19.0
    assert s["ttft_ms"]["p50"] == pytest.approx(200) and s["tpot_ms"]["mean"] == pytest.approx(150)
    assert s["tbt_slo_attainment"] == 0.5 and s["tbt_slo_token_share"] == pytest.approx(4 / 6)
    assert "TBT SLO 150 ms" in format_table(s)


def test_summary_splits_ttft_by_prefix_cache_hit():
    rs = [RequestResult(prompt_len=100, output_len=2, ttft=t, latency=1.0, gaps=[0.1], ok=True, cached_tokens=c)
          for t, c in ((0.4, 0), (0.5, 0), (0.1, 96), (0.2, 64), (0.3, None))]  # None: the server did not say
    s = summarize(rs, duration_s=1.0, slo_tbt_ms=150)
    assert s["ttft_cache_hit_ms"]["mean"] == pytest.approx(150) and s["ttft_cache_miss_ms"]["mean"] == pytest.approx(450)
    assert s["cache_hit_requests"] == 2 and s["cached_tokens"] == 160
    assert "prefix-cache hits" in format_table(s)


def test_bench_serve_cli(tiny_mixtral, tmp_path, capsys):
    app = build_app(EngineConfig(model=str(tiny_mixtral), num_kv_blocks=64), ServerOptions(served_model_name="tiny"))
    with BackgroundServer(app) as url:
        rc = afdserve(["bench", "serve", "--base-url", url, "--dataset", "synthetic", "--num-prompts", "12",
                       "--input-len", "20", "--output-len", "10", "--request-rate", "20", "--tokenizer",
                       str(tiny_mixtral), "--result-json", str(tmp_path / "r.json"), "--plot",
                       str(tmp_path / "r.png"), "--no-progress"])
        rc_chat = afdserve(["bench", "serve", "--base-url", url, "--dataset", "sharegpt", "--endpoint", "chat",
                            "--num-prompts", "6", "--sharegpt-max-input-len", "200", "--sharegpt-max-output-len", "8",
                            "--max-concurrency", "3", "--tokenizer", str(tiny_mixtral), "--result-json",
                            str(tmp_path / "c.json"), "--plot", "", "--no-progress"])
    assert rc == 0 and rc_chat == 0
    out = json.loads((tmp_path / "r.json").read_text())
    s = out["summary"]
    assert s["completed"] == 12 and s["failed"] == 0 and s["output_tokens"] == 120
    assert s["ttft_ms"]["p99"] > 0 and s["tbt_ms"]["p50"] > 0 and 0 <= s["tbt_slo_attainment"] <= 1
    assert len(out["requests"]) == 12 and out["config"]["request_rate"] == 20.0
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "c.json").read_text())["summary"]["completed"] == 6
    assert "output token throughput" in capsys.readouterr().out


def test_chat_templates():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Bye"}]
    mixtral = ChatTemplate(MIXTRAL_CHAT_TEMPLATE, "<s>", "</s>")
    assert mixtral.render(msgs) == "<s>[INST] S\n\nHi [/INST] Yo</s>[INST] Bye [/INST]"
    with pytest.raises(RequestError, match="alternate"):
        mixtral.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    default = ChatTemplate(None, "<s>", "</s>")
    assert default.is_default and default.source == DEFAULT_CHAT_TEMPLATE
    assert default.render(msgs[1:2]) == "<s>user: Hi\nassistant:"
