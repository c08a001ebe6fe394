"""Benchmark of ``afdserve.balance.route_replicas``: latency per batch, and balance per placement.

Latency: for each shape (tokens T, top-k, experts E, workers N, slots per worker C) a JANUS plan is
made from a synthetic load snapshot (skewed popularity, co-activated groups), ``--batches`` distinct
synthetic batches are drawn, and every call routes the next batch (round-robin over them, so the
input is not hot in cache) — ``--rounds`` passes; median / p90 / p99 / min of single calls, timed
with ``perf_counter_ns``. The first shape is the acceptance target (256 tokens, top-8, 16 workers).

Planners: for a few realistic sizes (4 synthetic layers), each planner's objective relative to
round-robin, MegaScale-Infer's relative to the lower bound ``sum_i w_i / N``, and planning time.

Balance: for the main shape's E, N, C at T = 64 and 256 tokens, placements (round-robin, MegaScale-Infer, JANUS) x routing policies
(``activated`` greedy, ``shares`` split, random replica) over fresh batches of the same synthetic
router: activated experts per worker (max, max - min) and tokens per worker (max / mean).

    python benchmarks/routing_bench.py [--json out/routing_bench.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from afdserve.balance.load import LoadTracker
from afdserve.balance.objective import objective
from afdserve.balance.placement import LayerPlacement, round_robin, round_robin_layer
from afdserve.balance.planners import plan_janus, plan_megascale
from afdserve.balance.routing import activated_per_worker, route_replicas, tokens_per_worker
from afdserve.balance.synthetic import SyntheticRouting

SHAPES = [  # (tokens, top-k, experts, workers, slots per worker)
    (256, 8, 256, 16, 20),  # acceptance target: 256 tokens top-8 over 16 workers, 25% spare slots
    (256, 8, 128, 16, 10),
    (256, 8, 256, 16, 32),  # 100% spare slots: every expert has ~2 replicas
    (256, 8, 256, 32, 10),
    (64, 8, 256, 16, 20),
    (1024, 8, 256, 16, 20),
    (256, 6, 160, 16, 12),  # DeepSeek-V2-like
]


@dataclass
class Timing:
    tokens: int
    top_k: int
    experts: int
    workers: int
    slots: int
    policy: str
    replicated_experts: int
    calls: int
    median_us: float
    p90_us: float
    p99_us: float
    min_us: float


@dataclass
class PlannerResult:
    experts: int
    top_k: int
    workers: int
    slots: int
    kind: str
    plan_over_round_robin: float
    plan_over_lower_bound: float | None
    seconds_per_layer: float


@dataclass
class Balance:
    tokens: int
    placement: str
    policy: str
    max_activated: float
    activated_spread: float
    max_over_mean_tokens: float


def time_shape(t: int, k: int, e: int, n: int, c: int, policy: str, batches: int, rounds: int, seed: int) -> Timing:
    sr = SyntheticRouting.make(1, e, k, seed=seed)
    snap = sr.snapshot(t, 8, seed=seed + 1)
    lp = (plan_janus(snap, n, c) if policy == "activated" else plan_megascale(snap, n, c)).layers[0]
    g = torch.Generator().manual_seed(seed + 2)
    inputs = [sr.sample(0, t, g) for _ in range(batches)]
    for ids in inputs[: min(8, batches)]:  # warm-up (builds the cached replica table)
        route_replicas(ids, lp, policy=policy)
    ns = []
    for _ in range(rounds):
        for ids in inputs:
            t0 = time.perf_counter_ns()
            route_replicas(ids, lp, policy=policy)
            ns.append(time.perf_counter_ns() - t0)
    us = np.array(ns) / 1e3
    return Timing(
        t, k, e, n, c, policy, int((lp.replica_counts() > 1).sum()), len(ns),
        float(np.median(us)), float(np.percentile(us, 90)), float(np.percentile(us, 99)), float(us.min()),
    )


def balance(t: int, k: int, e: int, n: int, c: int, batches: int, seed: int) -> list[Balance]:
    sr = SyntheticRouting.make(1, e, k, seed=seed)
    snap = sr.snapshot(t, 8, seed=seed + 1)
    placements: dict[str, LayerPlacement] = {
        "round-robin": round_robin_layer(e, n, c),
        "megascale": plan_megascale(snap, n, c).layers[0],
        "janus": plan_janus(snap, n, c).layers[0],
    }
    rng = np.random.default_rng(seed)
    out = []
    for name, lp in placements.items():
        policies = ["activated"] if name == "round-robin" else ["activated", "shares", "random"]
        for policy in policies:
            g = torch.Generator().manual_seed(seed + 3)  # the same batches for every row
            mx, spread, tok = [], [], []
            for _ in range(batches):
                ids = sr.sample(0, t, g)
                if policy == "random":
                    pick = torch.tensor([int(rng.choice(lp.replicas_of(x))) for x in range(e)])
                    workers = pick[ids]
                else:
                    workers = route_replicas(ids, lp, policy=policy)  # type: ignore[arg-type]
                act = activated_per_worker(ids, workers, n, e)
                mx.append(int(act.max()))
                spread.append(int(act.max() - act.min()))
                tok.append(float(tokens_per_worker(workers, n).max()) / (t * k / n))
            out.append(Balance(t, name, policy, float(np.mean(mx)), float(np.mean(spread)), float(np.mean(tok))))
    return out


def time_record(t: int, k: int, e: int, layers: int, calls: int, seed: int) -> dict[str, float]:
    """Median microseconds of one ``LoadTracker.record`` call (CPU), with and without co-activation."""
    sr = SyntheticRouting.make(1, e, k, seed=seed)
    g = torch.Generator().manual_seed(seed)
    inputs = [sr.sample(0, t, g) for _ in range(16)]
    out = {}
    for co in (False, True):
        tracker = LoadTracker(layers, e, window=64, coactivation=co)
        ns = []
        for i in range(calls):
            ids = inputs[i % len(inputs)]
            t0 = time.perf_counter_ns()
            tracker.record(i % layers, ids)
            ns.append(time.perf_counter_ns() - t0)
            if i % layers == layers - 1:
                tracker.step()
        out["with_coactivation" if co else "tokens_only"] = float(np.median(ns)) / 1e3
    return out


PLANNER_SHAPES = [(64, 8, 8, 10), (128, 8, 16, 10), (160, 6, 32, 6), (256, 8, 16, 20), (256, 8, 32, 10)]


def planners(seed: int, layers: int = 4) -> list[PlannerResult]:
    out = []
    for e, k, n, c in PLANNER_SHAPES:
        snap = SyntheticRouting.make(layers, e, k, seed=seed).snapshot(256, 8, seed=seed + 1)
        rr = round_robin(e, n, c, layers)
        for kind in ("megascale", "janus"):
            t0 = time.perf_counter()
            p = plan_megascale(snap, n, c) if kind == "megascale" else plan_janus(snap, n, c)
            dt = (time.perf_counter() - t0) / layers
            ratio = objective(p, snap, kind) / objective(rr, snap, kind)
            bound = None
            if kind == "megascale":  # sum over layers of sum_i a_i / N
                bound = objective(p, snap, kind) / float((snap.tokens_per_step().sum(1) / n).sum())
            out.append(PlannerResult(e, k, n, c, kind, ratio, bound, dt))
    return out


def environment() -> dict[str, object]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "loadavg_1m_at_start": os.getloadavg()[0],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write results as JSON")
    ap.add_argument("--batches", type=int, default=64, help="distinct batches per shape")
    ap.add_argument("--rounds", type=int, default=30, help="passes over the batches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="first shape only, fewer calls")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: on a shared, "
                    "oversubscribed host multi-threaded small ops stall)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shapes = SHAPES[:1] if args.quick else SHAPES
    rounds = 5 if args.quick else args.rounds

    env = environment()
    print(
        f"# route_replicas latency on {env['cpu']} ({env['cpus']} CPUs, load average {env['loadavg_1m_at_start']:.2f}), "
        f"numpy {env['numpy']}, torch {env['torch']}"
    )
    print("| T | k | E | N | C | policy | replicated experts | calls | median us | p90 us | p99 us | min us |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    timings = []
    for shape in shapes:
        for policy in ("activated", "shares"):
            r = time_shape(*shape, policy=policy, batches=args.batches, rounds=rounds, seed=args.seed)
            timings.append(r)
            print(
                f"| {r.tokens} | {r.top_k} | {r.experts} | {r.workers} | {r.slots} | {r.policy} | {r.replicated_experts} | {r.calls} "
                f"| {r.median_us:.1f} | {r.p90_us:.1f} | {r.p99_us:.1f} | {r.min_us:.1f} |"
            )
    target = timings[0]
    print(f"\ntarget (256 tokens, top-8, 16 workers, activated): median {target.median_us:.1f} us, p99 {target.p99_us:.1f} us "
          f"-> {'under' if target.median_us < 100 else 'OVER'} 100 us")

    _, k, e, n, c = SHAPES[0]
    bal = []
    for t in (64, 256):
        bal += balance(t, k, e, n, c, batches=16 if args.quick else 100, seed=args.seed)
    print(f"\n# balance, k={k} E={e} N={n} C={c}: per batch, averaged over fresh batches")
    print("| T | placement | routing | max activated experts / worker | max - min activated | max / mean tokens per worker |")
    print("|---|---|---|---|---|---|")
    for b in bal:
        print(f"| {b.tokens} | {b.placement} | {b.policy} | {b.max_activated:.2f} | {b.activated_spread:.2f} | {b.max_over_mean_tokens:.2f} |")

    plans = planners(args.seed) if not args.quick else []
    if plans:
        print("\n# planners, 4 synthetic layers, 256 tokens x 8 steps per snapshot: objective (sum over layers of the max worker)")
        print("| E | k | N | C | planner | plan / round-robin | plan / lower bound | s per layer |")
        print("|---|---|---|---|---|---|---|---|")
        for p in plans:
            lb = f"{p.plan_over_lower_bound:.3f}" if p.plan_over_lower_bound is not None else "-"
            print(f"| {p.experts} | {p.top_k} | {p.workers} | {p.slots} | {p.kind} | {p.plan_over_round_robin:.3f} | {lb} | {p.seconds_per_layer:.3f} |")

    rec = time_record(256, 8, 256, layers=4, calls=400 if args.quick else 4000, seed=args.seed)
    print(
        f"\n# LoadTracker.record, 256 tokens top-8, 256 experts, CPU: median {rec['tokens_only']:.1f} us tokens only, "
        f"{rec['with_coactivation']:.1f} us with co-activation"
    )

    env["loadavg_1m_at_end"] = os.getloadavg()[0]
    print(f"\nload average at the end: {env['loadavg_1m_at_end']:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "environment": env,
                    "timings": [asdict(x) for x in timings],
                    "balance": [asdict(x) for x in bal],
                    "planners": [asdict(x) for x in plans],
                    "record_us": rec,
                },
                indent=2,
            )
        )
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
