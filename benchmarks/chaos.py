"""Chaos: concurrent greedy streams against a disaggregated server while workers are killed and stalled.

A server (2 attention + 3 expert workers by default, the demo model) runs in this process. First a
fault-free pass records each prompt's greedy output and the throughput; then the same workload runs
again while, every ``--fault-every`` seconds, the next event of a fixed cycle happens: a random worker
killed (SIGKILL), a random worker stopped for 5 s (SIGSTOP, then SIGCONT), an expert worker added,
killed again, the expert worker removed, an attention worker added and removed (``POST /admin/scale``).
Each stream's token ids are compared with its fault-free output. Prints a table and writes JSON: failed
requests, differing outputs, recovery time per fault (from the loss being noticed to every worker up
again, as the front end measured it; a stop is noticed after ``heartbeat_timeout_ms`` or the peers'
deadline), time per resize, throughput against the fault-free pass.

    python benchmarks/chaos.py [--duration 120] [--streams 32] [--fault-every 20] [--json out/chaos.json]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import secrets
import signal
import statistics
import threading
import time

import httpx

# the events of the faulty pass, in this order, one every --fault-every seconds
CYCLE = ["kill", "stop", "expert +1", "kill", "expert -1", "attention +1", "kill", "attention -1"]


def workload(url: str, requests: list, streams: int, seconds: float | None) -> tuple[list, float]:
    """``streams`` concurrent greedy streams cycling through ``requests`` for ``seconds`` (None: each
    request once): ``afdserve.bench.loadgen``'s closed loop. Returns the results and tokens/s."""
    from afdserve.bench.loadgen import LoadSpec, run_load

    spec = LoadSpec(base_url=url, model="demo", max_concurrency=streams, duration_s=seconds, timeout_s=300.0)
    results, elapsed = asyncio.run(run_load(spec, requests))
    return results, sum(len(r.token_ids) for r in results) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of the faulty pass")
    ap.add_argument("--baseline", type=float, default=40.0, help="seconds of the fault-free pass")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--fault-every", type=float, default=20.0)
    ap.add_argument("--attention-workers", type=int, default=2)
    ap.add_argument("--expert-workers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default="out/chaos.json")
    args = ap.parse_args()

    from afdserve.bench.workload import BenchRequest
    from afdserve.config import EngineConfig
    from afdserve.serving.server import BackgroundServer, ServerOptions, build_app

    # float32: greedy tokens do not depend on which requests share a batch (bfloat16 rounding can flip
    # near-ties, so outputs would differ between batchings even without faults)
    cfg = EngineConfig(dtype=args.dtype, attention_workers=args.attention_workers, expert_workers=args.expert_workers,
                       micro_batches=2, max_num_seqs=args.streams)
    token = secrets.token_hex(8)
    app = build_app(cfg, ServerOptions(served_model_name="demo", log_level="error", admin_token=token))
    cluster = app.state.engine.engine
    rng = random.Random(args.seed)
    prompts = [" ".join(rng.choice(["the", "a", "model", "expert", "token", "layer", "fast", "cache"])
                        for _ in range(rng.randrange(4, 16))) for _ in range(64)]
    requests = [BenchRequest(p, len(p.split()), args.max_tokens) for p in prompts]
    with BackgroundServer(app, log_level="error") as url:
        want = {r.index: r.token_ids for r in workload(url, requests, 1, None)[0]}  # fault-free, one at a time
        base, base_tps = workload(url, requests, args.streams, args.baseline)
        faults: list[dict] = []
        stop = threading.Event()

        def chaos() -> None:
            for kind in itertools.cycle(CYCLE):
                if stop.wait(args.fault_every):
                    return
                if kind in ("kill", "stop"):
                    name = rng.choice(sorted(dict(cluster.workers)))
                    pid = cluster.workers[name].pid
                    faults.append({"t": time.monotonic(), "worker": name, "fault": kind})
                    os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                    if kind == "stop":
                        time.sleep(5)  # the fault: a 5 s stall
                        try:
                            os.kill(pid, signal.SIGCONT)
                        except ProcessLookupError:
                            pass
                    continue
                role, step = kind.split()
                key = f"{role}_workers"
                size = (len(cluster.attention) if role == "attention" else len(cluster.experts)) + int(step)
                r = httpx.post(f"{url}/admin/scale", json={key: size}, timeout=600,
                               headers={"Authorization": f"Bearer {token}"})
                faults.append({"t": time.monotonic(), "worker": f"{role} pool -> {size}", "fault": "scale",
                               "status": r.status_code, "seconds": r.json().get("seconds")})

        th = threading.Thread(target=chaos, daemon=True)
        th.start()
        results, tps = workload(url, requests, args.streams, args.duration)
        stop.set()
        th.join()
        recovery = list(cluster.membership.recovery_seconds)
        resizes = list(cluster.membership.resize_seconds)
        restarts = dict(cluster.membership.restarts)
    failed = [r.error for r in results if not r.ok]
    differ = sum(1 for r in results if r.ok and r.token_ids != want[r.index])
    base_differ = sum(1 for r in base if r.ok and r.token_ids != want[r.index])
    row = {"requests": len(results), "failed": len(failed), "differing": differ,
           "differing_without_faults": base_differ, "faults": len(faults),
           "recoveries": len(recovery), "recovery_median_s": statistics.median(recovery) if recovery else None,
           "recovery_max_s": max(recovery) if recovery else None, "resizes": len(resizes),
           "resize_median_s": statistics.median(resizes) if resizes else None,
           "scale_calls_failed": sum(1 for f in faults if f["fault"] == "scale" and f["status"] != 200),
           "throughput_tok_s": tps,
           "fault_free_tok_s": base_tps, "throughput_ratio": tps / base_tps if base_tps else None}
    print(f"{'requests':>8} {'failed':>6} {'differ':>6} {'faults':>6} {'recov med s':>11} {'recov max s':>11} "
          f"{'tok/s':>8} {'fault-free':>10} {'ratio':>6}")
    print(f"{row['requests']:>8} {row['failed']:>6} {row['differing']:>6} {row['faults']:>6} "
          f"{row['recovery_median_s'] or float('nan'):>11.2f} {row['recovery_max_s'] or float('nan'):>11.2f} "
          f"{tps:>8.1f} {base_tps:>10.1f} {row['throughput_ratio'] or float('nan'):>6.2f}")
    for f in faults:
        print(f"  fault: {f['fault']:<5} {f['worker']}" + (f" (HTTP {f['status']}, {f['seconds'] or 0:.1f} s)"
                                                          if f["fault"] == "scale" else ""))
    print(f"  resizes: {len(resizes)}, median {row['resize_median_s'] or float('nan'):.2f} s until every worker was up")
    print(f"  fault-free pass: {len(base)} requests, {base_differ} differing from the one-at-a-time outputs")
    if failed:
        print("  first failures:", failed[:3])
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump({"settings": vars(args), "summary": row, "faults": faults, "restarts": restarts,
                   "recovery_s": recovery, "resize_s": resizes, "failures": failed[:20]}, fh, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
