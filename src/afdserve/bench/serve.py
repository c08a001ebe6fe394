"""``afdserve bench serve``: load a running OpenAI-compatible server and report throughput, TTFT,
time between tokens and TBT SLO attainment (table, JSON, plot)."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from afdserve.bench.loadgen import LoadSpec, run_load, send
from afdserve.bench.serve_report import format_table, plot, summarize, write_json
from afdserve.bench.workload import BenchRequest, sharegpt_requests, synthetic_requests, vocab_size

PAPER_INPUT_LEN, PAPER_OUTPUT_LEN = 571, 159  # median ShareGPT lengths quoted by MegaScale-Infer


@dataclass(frozen=True)
class ServeBenchOptions:
    """One run of the serving benchmark (the flags of ``afdserve bench serve``)."""

    base_url: str = "http://127.0.0.1:8000"  # server URL (without /v1)
    model: str | None = None  # model name to request (None: the server's first model)
    endpoint: str = "completions"  # or "chat"
    dataset: str = "sharegpt"  # or "synthetic"
    num_prompts: int = 200  # requests to send (cycled while ``duration`` lasts)
    input_len: int = PAPER_INPUT_LEN  # synthetic prompt tokens
    output_len: int = PAPER_OUTPUT_LEN  # synthetic output tokens
    sharegpt_max_input_len: int | None = None
    sharegpt_max_output_len: int | None = None
    request_rate: float = math.inf  # Poisson arrival rate, req/s (inf: all at once)
    max_concurrency: int | None = None
    duration: float | None = None  # keep sending for this many seconds
    slo_tbt_ms: float = 100.0
    ignore_eos: bool = True
    tokenizer: str | None = None  # model folder whose tokenizer.json measures prompts (None: the demo model)
    seed: int = 0
    request_timeout: float = 600.0  # seconds per request
    result_json: str | None = "bench_serve.json"
    plot: str | None = "bench_serve.png"
    label: str = ""
    no_progress: bool = False


def _model(base_url: str, model: str | None) -> tuple[str, int | None]:
    r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    cards = r.json()["data"]
    card = next((c for c in cards if c["id"] == model), None) if model else (cards[0] if cards else None)
    if card is None:
        raise SystemExit(f"bench serve: the server does not serve {model!r} (it serves {[c['id'] for c in cards]})")
    return card["id"], card.get("max_model_len")


def build_requests(opts: ServeBenchOptions, max_model_len: int | None) -> list[BenchRequest]:
    from afdserve.engine.builder import resolve_model
    from afdserve.engine.tokenizer import load_tokenizer

    path = resolve_model(opts.tokenizer)
    tok = load_tokenizer(path).tokenizer
    if opts.dataset == "synthetic":
        return synthetic_requests(opts.num_prompts, opts.input_len, opts.output_len, vocab_size(path, tok), opts.seed)
    return sharegpt_requests(tok, opts.num_prompts, opts.seed, opts.sharegpt_max_input_len,
                             opts.sharegpt_max_output_len, max_model_len)


def run_serve_bench(opts: ServeBenchOptions) -> dict[str, Any]:
    """Runs the benchmark; returns {"summary", "config"} (and writes the files)."""
    model, max_len = _model(opts.base_url, opts.model)
    requests = build_requests(opts, max_len)
    spec = LoadSpec(base_url=opts.base_url, model=model, endpoint=opts.endpoint, request_rate=opts.request_rate,
                    max_concurrency=opts.max_concurrency, duration_s=opts.duration, ignore_eos=opts.ignore_eos,
                    timeout_s=opts.request_timeout, seed=opts.seed)

    async def warmup() -> None:
        async with httpx.AsyncClient(timeout=opts.request_timeout) as client:
            probe = requests[0]
            res = await send(client, spec, BenchRequest(probe.prompt, probe.prompt_len, 4), time.perf_counter())
            if not res.ok:
                raise SystemExit(f"bench serve: the first request failed: {res.error}")

    asyncio.run(warmup())
    load_start = os.getloadavg()
    bar = None
    if not opts.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=None if opts.duration else len(requests), unit="req", file=sys.stderr,
                   desc=opts.label or "bench serve")
    results, elapsed = asyncio.run(run_load(spec, requests, on_done=(lambda r: bar.update(1)) if bar else None))
    if bar:
        bar.close()
    summary = summarize(results, elapsed, opts.slo_tbt_ms)
    config = asdict(opts) | {"model": model, "spec": asdict(spec), "label": opts.label,
                             "client_host": {"cpus": os.cpu_count(), "loadavg_1m_start": load_start[0],
                                             "loadavg_1m_end": os.getloadavg()[0]}}
    print(format_table(summary))
    if opts.result_json:
        write_json(opts.result_json, summary, config, results)
    if opts.plot:
        plot(opts.plot, results, summary, title=opts.label or f"{model} @ {opts.request_rate} req/s")
    return {"summary": summary, "config": config}
