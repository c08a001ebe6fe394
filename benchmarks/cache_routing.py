"""Cache-aware routing across attention workers: prefix-cache hit rate and TTFT, routed by the
longest cached prefix (``ClusterClient.routes``) against the attention balancer alone.

The demo model, ``--attention`` attention workers and one expert worker, driven through
``EngineClient``: ``--requests`` requests, each one of ``--prefixes`` shared prefixes of
``--prefix`` tokens plus 16 fresh tokens, issued in waves of ``--wave`` at once (the prefix of each
drawn at random, the same sequence for both modes). Each worker's KV cache holds ``--kv-blocks``
blocks and no host tier, so that one worker cannot keep every prefix but two can, between them.
Each mode runs on a fresh deployment.

    python benchmarks/cache_routing.py [--requests 48] [--json out/cache_routing.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time

from afdserve import SamplingParams
from afdserve.cluster import build_client
from afdserve.config import EngineConfig

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(10, vocab) for _ in range(args.prefix)] for _ in range(args.prefixes)]
    return [rng.choice(prefixes) + [rng.randrange(10, vocab) for _ in range(16)] for _ in range(args.requests)]


def run_mode(args: argparse.Namespace, cache_aware: bool) -> dict:
    client = build_client(EngineConfig(model=args.model, attention_workers=args.attention, expert_workers=1,
                                       micro_batches=1, num_threads=args.threads, num_kv_blocks=args.kv_blocks, max_model_len=1024,
                                       prefix_cache_host_gb=0.0))
    try:
        if not cache_aware:
            client.routes = None  # the attention balancer alone
        prompts = workload(args, client.vocab_size)
        ttft, cached, owners = [], [], []
        for i in range(0, len(prompts), args.wave):
            t0 = time.perf_counter()
            rids = {client.add_request({"prompt_token_ids": p}, PARAMS): p for p in prompts[i:i + args.wave]}
            owners += [client.owner[r] for r in rids]
            first: dict[str, float] = {}
            left = set(rids)
            while left:
                for o in client.get_outputs(0.01):
                    if o.request_id in rids and o.outputs[0].token_ids and o.request_id not in first:
                        first[o.request_id] = time.perf_counter() - t0
                    if o.finished and o.request_id in left:
                        left.discard(o.request_id)
                        cached.append(o.num_cached_tokens or 0)
            ttft += list(first.values())
        total = sum(len(p) for p in prompts)
        return {"hit_rate": sum(cached) / total, "requests_with_hits": sum(c > 0 for c in cached),
                "median_ttft_s": statistics.median(ttft), "mean_ttft_s": statistics.fmean(ttft),
                "requests_per_worker": {w: owners.count(w) for w in sorted(set(owners))}}
    finally:
        client.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the demo model)")
    ap.add_argument("--attention", type=int, default=2)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=192, help="KV blocks of each attention worker")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--wave", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="of the workload")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default="out/cache_routing.json")
    args = ap.parse_args()
    results = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
               "config": vars(args)}
    for name, aware in (("cache_aware", True), ("balancer_only", False)):
        results[name] = run_mode(args, aware)
        print(name, json.dumps(results[name]))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
