"""Async jobs with a long prompt: progress, cancellation, TTL (the issue's acceptance on jobs).

On the demo model (its context holds 4,096 tokens), with ``--chunk``-token prefill chunks
(``max_num_batched_tokens``), colocated and disaggregated (1 attention + 1 expert worker):

* ``http`` — through the API server: a ``--prompt``-token (3,000) prompt as a job, polled with
  ``GET /v1/jobs/{id}`` until it succeeds: the progress reports (how many, monotone or not), the
  reported rate, the result against the same request made synchronously (greedy: identical), and
  the result still there just before ``--ttl`` and gone (404) just after. Then another fresh prompt
  as a job, followed with ``/events`` and cancelled (``DELETE``) once a third of it is prefilled:
  the seconds until ``/metrics`` shows the KV cache empty again.
* ``abort`` — through ``EngineClient``: the same cancel mid-prefill, counting the chunks the worker
  computed for the request after the abort was sent (from its raw outputs), and its KV blocks after.

    python benchmarks/jobs.py [--parts http,abort] [--rounds 3] [--chunk 256] [--json out/jobs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

import httpx

from afdserve import SamplingParams
from afdserve.bench.soak import kv_usage, scrape
from afdserve.bench.sse import named_events
from afdserve.cluster import build_client
from afdserve.config import EngineConfig
from afdserve.serving.server import BackgroundServer, ServerOptions, build_app

DEPLOYMENTS = {"colocated": dict(expert_workers=0), "disaggregated": dict(expert_workers=1, micro_batches=1)}


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _wait_idle(url: str, timeout: float = 30.0) -> float:
    t0 = time.perf_counter()
    while True:
        m = scrape(url)
        if m["afdserve_num_requests_in_flight"] == 0 and not any(kv_usage(m).values()):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"KV cache not empty after {timeout} s: {kv_usage(m)}")
        time.sleep(0.02)


def http_round(url: str, model: str, rng: random.Random, vocab: int, args: argparse.Namespace) -> dict:
    body = {"model": model, "prompt": prompt(rng, args.prompt, vocab), "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    t0 = time.perf_counter()
    job = httpx.post(url + "/v1/jobs", json=body).json()
    views = []
    while True:
        v = httpx.get(f"{url}/v1/jobs/{job['id']}").json()
        views.append(v)
        if v["status"] in ("succeeded", "failed", "cancelled"):
            break
        time.sleep(0.02)
    finished = time.perf_counter()
    seconds = finished - t0
    done = [v["progress"]["prompt_tokens_done"] for v in views]
    rates = [v["progress"]["tokens_per_second"] for v in views if v["progress"]["tokens_per_second"]]
    sync = httpx.post(url + "/v1/completions", json=body, timeout=600).json()
    final = views[-1]
    identical = final["status"] == "succeeded" and final["result"]["choices"] == sync["choices"]
    time.sleep(max(0.0, finished + args.ttl - 1.0 - time.perf_counter()))
    before = httpx.get(f"{url}/v1/jobs/{job['id']}")
    time.sleep(max(0.0, finished + args.ttl + 0.5 - time.perf_counter()))
    after = httpx.get(f"{url}/v1/jobs/{job['id']}")
    # cancel a fresh one a third of the way through its prefill
    _wait_idle(url)
    job = httpx.post(url + "/v1/jobs", json=dict(body, prompt=prompt(rng, args.prompt, vocab))).json()
    at_cancel = None
    with httpx.stream("GET", f"{url}/v1/jobs/{job['id']}/events", timeout=600) as resp:
        for kind, data in named_events(resp.iter_lines()):
            if kind == "progress" and data["prompt_tokens_done"] >= args.prompt // 3:
                at_cancel = data["prompt_tokens_done"]
                t_cancel = time.perf_counter()
                status = httpx.delete(f"{url}/v1/jobs/{job['id']}").json()["status"]
                break
    _wait_idle(url)
    freed_s = time.perf_counter() - t_cancel  # from the DELETE (a cluster's KV figures refresh every second)
    return {"job_seconds": seconds, "seconds_per_chunk": seconds / -(-args.prompt // args.chunk),
            "progress_reports": len(set(done)), "monotone": done == sorted(done),
            "final_done": done[-1], "total": final["progress"]["prompt_tokens_total"],
            "reported_rate_tok_s": rates[-1] if rates else None, "result_identical_to_sync": identical,
            "sync_cached_tokens": sync["usage"]["prompt_tokens_details"]["cached_tokens"],
            "before_ttl_status": before.status_code, "result_before_ttl": before.json().get("result") is not None,
            "after_ttl_status": after.status_code, "cancel_status": status, "done_at_cancel": at_cancel,
            "kv_free_after_cancel_s": freed_s}


def part_http(args: argparse.Namespace) -> dict:
    out = {}
    for name, extra in DEPLOYMENTS.items():
        cfg = EngineConfig(model=args.model, max_num_batched_tokens=args.chunk, num_threads=args.threads, **extra)
        server = BackgroundServer(build_app(cfg, ServerOptions(served_model_name="m", job_ttl_s=args.ttl)))
        url = server.start()
        try:
            vocab = httpx.get(url + "/openapi.json").json()["components"]["schemas"]["DetokenizeRequest"][
                "properties"]["tokens"]["items"]["maximum"] + 1
            rng = random.Random(0)
            rounds = [http_round(url, "m", rng, vocab, args) for _ in range(args.rounds)]
        finally:
            server.stop()
        out[name] = {"rounds": rounds, "median_job_seconds": statistics.median(r["job_seconds"] for r in rounds),
                     "median_kv_free_after_cancel_s": statistics.median(r["kv_free_after_cancel_s"] for r in rounds)}
        print(name, json.dumps(out[name], indent=1))
    return out


def abort_round(client, rng: random.Random, args: argparse.Namespace) -> dict:
    rid = client.add_request({"prompt_token_ids": prompt(rng, args.prompt, client.vocab_size)},
                             SamplingParams(max_tokens=8))
    done = 0
    while done < args.prompt // 3:
        for o in client.get_outputs(0.1):
            if o.request_id == rid and o.prefill is not None:
                done = o.prefill.done
    client.abort(rid)
    after = done
    deadline = time.monotonic() + args.drain
    while time.monotonic() < deadline:  # the worker's raw outputs for it, until it is surely gone
        for o in client.poll(0.05):
            if o.request_id == rid and o.prefill is not None:
                after = max(after, o.prefill.done)
    stats = client.worker_stats() if hasattr(client, "worker_stats") else None
    usage = {n: s.kv_usage for n, s in stats.items() if n.startswith("attention")} if stats is not None \
        else {"engine": client.engine.blocks.usage}
    return {"done_at_abort": done, "max_done_after_abort": after,
            "chunks_after_abort": -(-(after - done) // args.chunk), "kv_usage_after": usage}


def part_abort(args: argparse.Namespace) -> dict:
    out = {}
    for name, extra in DEPLOYMENTS.items():
        client = build_client(EngineConfig(model=args.model, max_num_batched_tokens=args.chunk,
                                           num_threads=args.threads, **extra))
        try:
            rng = random.Random(1)
            rounds = [abort_round(client, rng, args) for _ in range(args.rounds)]
        finally:
            client.shutdown()
        out[name] = {"rounds": rounds, "max_chunks_after_abort": max(r["chunks_after_abort"] for r in rounds)}
        print(name, json.dumps(out[name], indent=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the demo model)")
    ap.add_argument("--parts", default="http,abort")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=3000, help="prompt tokens of a job")
    ap.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens: tokens per prefill step")
    ap.add_argument("--ttl", type=float, default=3.0, help="the server's --job-ttl")
    ap.add_argument("--drain", type=float, default=1.0, help="seconds to watch a request's outputs after its abort")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default="out/jobs.json")
    args = ap.parse_args()
    results: dict = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
                     "model": args.model or "demo", "prompt": args.prompt, "chunk": args.chunk, "ttl": args.ttl}
    parts = args.parts.split(",")
    if "http" in parts:
        results["http"] = part_http(args)
    if "abort" in parts:
        results["abort"] = part_abort(args)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
