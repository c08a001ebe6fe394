"""Expert replication on a skewed router, measured side by side in one run.

The checkpoint is the demo architecture (vocabulary cut to 4096 for speed) with a router that
strongly favours experts 0 and 1: every token embedding carries a constant channel, and the gate
rows of the hot experts read it. Both hot experts sit on expert worker 0 under the default
contiguous placement, so that worker is the straggler of every layer.

  no replicas: 2 expert workers x 4 slots (contiguous placement)
  replicas:    2 expert workers x 5 slots, placed by the JANUS planner from the measured load
               (re-planned live on the running deployment)

Reports decode throughput, the max/mean load ratio of the expert workers (token-expert pairs
computed), and whether greedy outputs are identical.

    python benchmarks/balance.py [--json out/balance.json] [--plot out/balance.png] [--cluster ray [--ray-address A]]
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


def worker_loads(llm) -> list[int]:
    """Token-expert pairs each expert worker computed so far."""
    stats = llm.engine.collect("stats")
    return [int(torch.tensor(stats[n]["tokens_per_expert"])[:, :-1].sum()) for n in sorted(llm.engine.experts)]


def measure(path: Path, batch: int, tokens: int, prompt_len: int, replicate: bool, slots: int,
            cluster: str = "local") -> dict:
    from afdserve import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(prompt_len)]} for _ in range(batch)]
    kw = dict(expert_workers=2, micro_batches=2, num_threads=1, max_num_seqs=batch, kv_cache_gb=0.5, cluster=cluster)
    with LLM(str(path), **kw) as llm:
        greedy = lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # noqa: E731
        llm.generate(prompts, greedy(4))  # warm-up; records the expert load
        snapshot = llm.engine.expert_load()
        if replicate:
            llm.engine.rebalance(slots_per_worker=slots)
        before = worker_loads(llm)

        def timed(n: int) -> tuple[float, list]:
            t0 = time.perf_counter()
            outs = llm.generate(prompts, greedy(n))
            return time.perf_counter() - t0, outs

        t1, _ = timed(1)
        tn, outs = timed(tokens)
        after = worker_loads(llm)
        placement = [[list(llm.engine.expert_map.placement.layers[0].experts_on(w))] for w in range(2)]
    loads = [a - b for a, b in zip(after, before)]
    tbt = (tn - t1) / (tokens - 1)
    return {"decode_tok_s": batch / tbt, "tbt_ms": tbt * 1e3, "worker_loads": loads,
            "max_mean_load": max(loads) / (sum(loads) / len(loads)), "placement_layer0": placement,
            "outputs": [o.outputs[0].token_ids for o in outs], "snapshot": snapshot.to_json() if snapshot else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--slots", type=int, default=5, help="expert slots per worker with replicas")
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/afdserve/skewed-demo-v2"))
    ap.add_argument("--json", default="out/balance.json")
    ap.add_argument("--plot", default="out/balance.png")
    ap.add_argument("--cluster", default="local", choices=["local", "ray"],
                    help="workers as local processes or Ray actors (docs/ray.md)")
    ap.add_argument("--ray-address", default=None, help="--cluster ray: the Ray cluster to join")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.cluster == "ray":
        import ray

        ray.init(address=args.ray_address)  # once: both deployments join this connection
    path = skewed_checkpoint(Path(args.model_dir))
    no = measure(path, args.batch, args.tokens, args.prompt_len, False, 4, args.cluster)
    rep = measure(path, args.batch, args.tokens, args.prompt_len, True, args.slots, args.cluster)
    res = {"throughput_no_replicas": no["decode_tok_s"], "throughput_replicas": rep["decode_tok_s"],
           "max_mean_load_no_replicas": no["max_mean_load"], "max_mean_load_replicas": rep["max_mean_load"],
           "outputs_identical": no["outputs"] == rep["outputs"],
           "worker_loads_no_replicas": no["worker_loads"], "worker_loads_replicas": rep["worker_loads"],
           "placement_layer0_replicas": rep["placement_layer0"], "batch": args.batch, "tokens": args.tokens}
    print(f"{'':<14} {'decode tok/s':>12} {'TBT ms':>8} {'max/mean load':>14}  worker loads (pairs)")
    for name, r in (("no replicas", no), ("replicas", rep)):
        print(f"{name:<14} {r['decode_tok_s']:>12.1f} {r['tbt_ms']:>8.2f} {r['max_mean_load']:>14.2f}  {r['worker_loads']}")
    print(f"throughput ratio {res['throughput_replicas'] / res['throughput_no_replicas']:.2f}x, "
          f"greedy outputs identical: {res['outputs_identical']}")
    print(f"replica placement (layer 0, per worker): {rep['placement_layer0']}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    if no["snapshot"]:
        snap_path = os.path.splitext(args.json)[0] + "_load.json"
        with open(snap_path, "w") as f:
            json.dump(no["snapshot"], f) if isinstance(no["snapshot"], dict) else f.write(no["snapshot"])
        print(f"load snapshot: {snap_path}  (draw it: afdserve expert-load {snap_path} --out PNG)")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        x = range(len(no["worker_loads"]))
        ax.bar([i - 0.2 for i in x], no["worker_loads"], 0.4, label="no replicas")
        ax.bar([i + 0.2 for i in x], rep["worker_loads"], 0.4, label=f"replicas ({args.slots} slots)")
        ax.set_xticks(list(x), [f"expert{i}" for i in x])
        ax.set_ylabel("token-expert pairs computed")
        ax.set_title("expert worker load, skewed router")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
