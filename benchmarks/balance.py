"""Expert replication on a skewed router, measured side by side in one run.

The checkpoint is the demo architecture (vocabulary cut to 4096 for speed) with a router that
strongly favours experts 0 and 1: every token embedding carries a constant channel, and the gate
rows of the hot experts read it. Both hot experts sit on expert worker 0 under the default
contiguous placement, so that worker is the straggler of every layer.

  no replicas: 2 expert workers x 4 slots (contiguous placement)
  replicas:    2 expert workers x 5 slots, placed by the JANUS planner from the measured load

One deployment switches live between the two (``rebalance``), alternating over ``--rounds``, so
both are measured by the same processes within seconds of each other.

Reports decode throughput, the max/mean load ratio of the expert workers (token-expert pairs
computed), and whether greedy outputs are identical.

    python benchmarks/balance.py [--json out/balance.json] [--plot out/balance.png] [--trace out/balance_trace.json]
        [--no-lend-idle-cores] [--cluster ray [--ray-address A]]
        [--capacity-factor F [--on-overflow drop|second-pass]]

With ``--capacity-factor`` the dispatch caps each expert worker's slot (afdserve.runtime.dispatch):
the counters of (token, k) pairs dropped and rows sent in a second pass are reported per placement,
next to the pairs routed (outputs are then compared only within a placement under ``drop``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

HOT = (0, 1)


def skewed_checkpoint(path: Path, strength: float = 0.2) -> Path:
    """The demo architecture with a router that favours experts ``HOT`` (deterministic)."""
    from afdserve.model.demo import build_demo_model

    if (path / "config.json").exists():
        return path
    tmp = path.with_name(path.name + ".tmp")
    build_demo_model(tmp, overrides={"vocab_size": 4096})
    index = json.loads((tmp / "model.safetensors.index.json").read_text())["weight_map"]
    by_file: dict[str, list[str]] = {}
    for name, f in index.items():
        by_file.setdefault(f, []).append(name)
    for f in by_file:
        tensors = load_file(tmp / f)
        for name, t in tensors.items():
            if name == "model.embed_tokens.weight":
                t[:, 0] = 1.0  # a constant channel in every token's hidden state
            elif name.endswith("block_sparse_moe.gate.weight"):
                t[list(HOT), 0] = strength  # the hot experts' gate rows read it
        save_file(tensors, tmp / f, metadata={"format": "pt"})
    tmp.rename(path)
    return path


def layer_loads(llm) -> list[list[int]]:
    """Per expert worker and layer, the token-expert pairs it computed so far."""
    stats = llm.engine.worker_stats()
    return [torch.tensor(stats[n].tokens_per_expert)[:, :-1].sum(1).tolist() for n in sorted(llm.engine.experts)]


def measure(path: Path, batch: int, tokens: int, prompt_len: int, slots: int, rounds: int, micro_batches: int,
            cluster: str = "local", trace: str | None = None, lend: bool = True,
            capacity: tuple[float | None, str] = (None, "second-pass")) -> dict:
    """One deployment (1 attention + 2 expert workers) switched live between the contiguous
    placement (no replicas, 4 slots a worker) and the JANUS plan of the measured load (``slots``
    a worker, hot experts replicated), ``rounds`` times each, alternating: both placements see
    the same processes, caches and this machine's speed drift. Medians are kept."""
    from afdserve import LLM, SamplingParams
    from afdserve.balance.planners import plan_janus

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(prompt_len)]} for _ in range(batch)]
    kw = dict(expert_workers=2, micro_batches=micro_batches, num_threads=1, max_num_seqs=batch,
              max_num_batched_tokens=batch * (prompt_len + 1), kv_cache_gb=1.0, cluster=cluster, trace=trace,
              lend_idle_cores=lend, expert_capacity_factor=capacity[0], on_expert_overflow=capacity[1])
    windows: dict[str, list[tuple[float, float]]] = {}  # per placement: its decode windows (epoch us)
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
    with LLM(str(path), **kw) as llm:
        llm.generate(prompts, greedy(4))  # warm-up; records the expert load
        snapshot = llm.engine.expert_load()
        placements = {"no_replicas": llm.engine.expert_map.placement,
                      "replicas": plan_janus(snapshot, 2, slots)}
        runs: dict[str, list[dict]] = {k: [] for k in placements}
        for r in range(rounds):
            for name in (list(placements) if r % 2 == 0 else list(placements)[::-1]):
                llm.engine.rebalance(placement=placements[name])
                before = layer_loads(llm)
                s0 = llm.engine.stats()
                t0 = time.perf_counter()
                llm.generate(prompts, greedy(1))
                t1 = time.perf_counter() - t0
                t0, w0 = time.perf_counter(), time.time_ns() / 1e3
                outs = llm.generate(prompts, greedy(tokens))
                tn = time.perf_counter() - t0
                windows.setdefault(name, []).append((w0, time.time_ns() / 1e3))
                per_layer = [[a - b for a, b in zip(wa, wb)] for wa, wb in zip(layer_loads(llm), before)]
                loads = [sum(w) for w in per_layer]
                tbt = (tn - t1) / (tokens - 1)
                s1 = llm.engine.stats()
                over = {"capacity_dropped": s1.capacity_dropped_assignments - s0.capacity_dropped_assignments,
                        "second_pass_rows": s1.second_pass_rows - s0.second_pass_rows}
                runs[name].append({"decode_tok_s": batch / tbt, "tbt_ms": tbt * 1e3, "worker_loads": loads, **over,
                                   "worker_layer_loads": per_layer,
                                   "outputs": [o.outputs[0].token_ids for o in outs]})
                print(f"  round {r}: {name:<12} {batch / tbt:8.1f} tok/s  worker loads {loads}"
                      + (f"  dropped {over['capacity_dropped']}, second-pass rows {over['second_pass_rows']}"
                         if capacity[0] is not None else ""), flush=True)
    out = {}
    for name, rs in runs.items():
        med = sorted(rs, key=lambda x: x["decode_tok_s"])[len(rs) // 2]
        loads = med["worker_loads"]
        out[name] = dict(med, max_mean_load=max(loads) / (sum(loads) / len(loads)),
                         runs_tok_s=[x["decode_tok_s"] for x in rs],
                         placement_layer0=[list(placements[name].layers[0].experts_on(w)) for w in range(2)],
                         all_outputs=[x["outputs"] for x in rs])
    out["snapshot"] = snapshot.to_json() if snapshot else None
    if trace:  # written when the deployment shut down
        out["trace"] = busy_in_windows(trace, windows)
    return out


def busy_in_windows(trace: str, windows: dict[str, list[tuple[float, float]]]) -> dict:
    """Per placement and worker, from the deployment's trace: the fraction of that placement's
    generate windows each worker spent in its compute spans (experts: "expert"; attention:
    "attention") and, for the attention worker, blocked on expert replies ("wait")."""
    from afdserve.runtime.trace_plot import load

    spans = load(trace)
    res = {}
    for name, wins in windows.items():
        total = sum(b - a for a, b in wins)
        inside = lambda s: any(a <= s["ts"] < b for a, b in wins)  # noqa: E731
        res[name] = {worker: {kind: round(sum(s["dur"] for s in evs if s["name"] == kind and inside(s)) / total, 3)
                              for kind in ("attention", "expert", "wait") if any(s["name"] == kind for s in evs)}
                     for worker, evs in spans.items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512,
                    help="concurrent sequences: large enough that the hot experts are compute-bound")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16, help="short: attention stays a small part of a step")
    ap.add_argument("--rounds", type=int, default=5, help="windows per placement, alternating")
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="1 (default): the attention worker sleeps while the experts compute, so the two expert "
                         "workers have the two cores to themselves and the slower one sets the pace; with m >= 2 "
                         "three processes time-share two cores and the total work, not the balance, sets it")
    ap.add_argument("--slots", type=int, default=5, help="expert slots per worker with replicas")
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/afdserve/skewed-demo-v2"))
    ap.add_argument("--json", default="out/balance.json")
    ap.add_argument("--plot", default="out/balance.png")
    ap.add_argument("--cluster", default="local", choices=["local", "ray"],
                    help="workers as local processes or Ray actors (docs/ray.md)")
    ap.add_argument("--ray-address", default=None, help="--cluster ray: the Ray cluster to join")
    ap.add_argument("--trace", default=None, metavar="PATH",
                    help="trace the deployment into PATH and report each worker's busy fraction per placement")
    ap.add_argument("--no-lend-idle-cores", action="store_true", help="workers do not lend their idle cores")
    ap.add_argument("--capacity-factor", type=float, default=None,
                    help="cap each expert worker's slot at F x its uniform-routing share (default: no cap)")
    ap.add_argument("--on-overflow", default="second-pass", choices=["second-pass", "drop"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cluster == "ray":
        import ray

        ray.init(address=args.ray_address)  # once: both deployments join this connection
    path = skewed_checkpoint(Path(args.model_dir))
    both = measure(path, args.batch, args.tokens, args.prompt_len, args.slots, args.rounds, args.micro_batches,
                   args.cluster, args.trace, not args.no_lend_idle_cores, (args.capacity_factor, args.on_overflow))
    no, rep = both["no_replicas"], both["replicas"]
    first = no["all_outputs"][0]
    res = {"throughput_no_replicas": no["decode_tok_s"], "throughput_replicas": rep["decode_tok_s"],
           "max_mean_load_no_replicas": no["max_mean_load"], "max_mean_load_replicas": rep["max_mean_load"],
           "outputs_identical": all(o == first for o in no["all_outputs"] + rep["all_outputs"])
           if args.capacity_factor is None or args.on_overflow != "drop" else  # drops differ by placement
           all(o == r["all_outputs"][0] for r in (no, rep) for o in r["all_outputs"]),
           "throughput_runs_no_replicas": no["runs_tok_s"], "throughput_runs_replicas": rep["runs_tok_s"],
           "micro_batches": args.micro_batches, "rounds": args.rounds,
           "round_ratios": [r / n for r, n in zip(rep["runs_tok_s"], no["runs_tok_s"])],
           "worker_loads_no_replicas": no["worker_loads"], "worker_loads_replicas": rep["worker_loads"],
           "placement_layer0_replicas": rep["placement_layer0"],
           "worker_layer_loads_no_replicas": no["worker_layer_loads"],
           "worker_layer_loads_replicas": rep["worker_layer_loads"], "batch": args.batch, "tokens": args.tokens,
           "lend_idle_cores": not args.no_lend_idle_cores, "busy_fractions": both.get("trace"),
           "capacity_factor": args.capacity_factor, "on_overflow": args.on_overflow,
           "capacity_counters": {name: {k: both[name][k] for k in ("capacity_dropped", "second_pass_rows")}
                                 | {"pairs_routed": sum(both[name]["worker_loads"])} for name in ("no_replicas", "replicas")}}
    print(f"{'':<14} {'decode tok/s':>12} {'TBT ms':>8} {'max/mean load':>14}  worker loads (pairs)")
    for name, r in (("no replicas", no), ("replicas", rep)):
        print(f"{name:<14} {r['decode_tok_s']:>12.1f} {r['tbt_ms']:>8.2f} {r['max_mean_load']:>14.2f}  {r['worker_loads']}")
    ratios = sorted(res["round_ratios"])
    res["round_ratio_median"] = ratios[len(ratios) // 2]
    print(f"throughput ratio (medians) {res['throughput_replicas'] / res['throughput_no_replicas']:.2f}x; "
          f"per round (the two windows of a round run back to back) {', '.join(f'{r:.2f}' for r in res['round_ratios'])}: "
          f"median {res['round_ratio_median']:.2f}x, replicas faster in {sum(r > 1 for r in ratios)}/{len(ratios)}; "
          f"greedy outputs identical: {res['outputs_identical']}")
    print(f"replica placement (layer 0, per worker): {rep['placement_layer0']}")
    if args.capacity_factor is not None:
        for name, c in res["capacity_counters"].items():
            print(f"capacity {args.capacity_factor} ({args.on_overflow}), {name}: {c['capacity_dropped']} pairs dropped, "
                  f"{c['second_pass_rows']} rows in a second pass, {c['pairs_routed']} pairs computed (median window)")
    for name, workers in (both.get("trace") or {}).items():
        print(f"busy fractions, {name}: " + "; ".join(f"{w} {kinds}" for w, kinds in sorted(workers.items())))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    if both["snapshot"]:
        snap_path = os.path.splitext(args.json)[0] + "_load.json"
        with open(snap_path, "w") as f:
            json.dump(both["snapshot"], f) if isinstance(both["snapshot"], dict) else f.write(both["snapshot"])
        print(f"load snapshot: {snap_path}  (draw it: afdserve expert-load {snap_path} --out PNG)")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        import numpy as np

        fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), gridspec_kw={"width_ratios": [1.4, 1, 1]})
        ax = axes[0]
        x = range(len(no["worker_loads"]))
        ax.bar([i - 0.2 for i in x], no["worker_loads"], 0.4, label="no replicas")
        ax.bar([i + 0.2 for i in x], rep["worker_loads"], 0.4, label=f"replicas ({args.slots} slots)")
        ax.set_xticks(list(x), [f"expert{i}" for i in x])
        ax.set_ylabel("token-expert pairs computed")
        ax.set_title("expert worker load, skewed router")
        ax.legend(fontsize=8)
        grids = [np.array(r["worker_layer_loads"], dtype=float).T for r in (no, rep)]  # [layers, workers]
        vmax = max(g.max() for g in grids)
        for ax, g, title in zip(axes[1:], grids, (f"before (max/mean {no['max_mean_load']:.2f})",
                                                   f"after (max/mean {rep['max_mean_load']:.2f})")):
            im = ax.imshow(g, aspect="auto", cmap="viridis", vmin=0, vmax=vmax)
            ax.set_xticks(range(g.shape[1]), [f"expert{i}" for i in range(g.shape[1])])
            ax.set_ylabel("layer")
            ax.set_title(title, fontsize=9)
        fig.colorbar(im, ax=axes[1:], label="pairs per worker and layer")
        fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
