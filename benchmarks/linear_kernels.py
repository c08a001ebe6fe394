"""The expert layer's GEMM paths on this CPU, side by side (bf16, the demo model's expert shapes).

For each token count T and thread count, one expert layer (every expert of the layer held, top-k
routing drawn uniformly) runs through:

* ``fused``: the fused MoE kernel (``afdserve.kernels``: every routed pair in one call; the default
  where the kernels are built);
* ``grouped``: ``torch._grouped_mm`` over the tokens sorted by expert (packing off);
* ``packed``: GEMMs on prepacked weights (the linear kernel, else oneDNN), one call per projection of
  each expert with rows;
* ``dense``: every held expert over every token in two packed oneDNN GEMMs (``ExpertPart``; it still
  declines a batch expected to touch fewer than half the experts, e.g. T = 1 with top-2 of 8).

Each round times every path once per layer of a stack of ``--layers`` expert layers (so weights come
from memory, not cache, as in a model), the paths' order rotated every round; medians over
``--rounds`` rounds, microseconds per layer, and the ratio to ``grouped``. ``ExpertPart`` picks
``dense`` for T up to ``DENSE_TOKENS_PER_THREAD`` x threads; this table is where that number comes


After the expert layers, the LM head at each T: its float32 logits, the logits and greedy sampling's
``argmax_rows``, and the greedy LM head (``linear_argmax``: each row's best logit and index, no logits).

``--routing even`` gives every expert the same number of rows (token t to experts t*k .. t*k+k-1,
modulo the experts): the cost of a layer by rows per expert, T*k/E.

    python benchmarks/linear_kernels.py [--tokens 4,8,16,32,64,128] [--threads 1,2] [--routing random|even]
                                        [--json out/linear_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from afdserve.model import experts as experts_mod
from afdserve.model import linear
from afdserve.model.config import ModelConfig
from afdserve.model.demo import demo_model_path
from afdserve.model.greedy import Best, argmax_rows
from afdserve.model.loader import CheckpointReader
from afdserve.model.model import ExpertModel, read_lm_head

PATHS = ("grouped", "packed", "dense", "fused")


def _set_path(path: str) -> None:
    os.environ["AFDSERVE_PACKED_WEIGHTS"] = "0" if path == "grouped" else "1"
    linear.reset_packing(keep_packed=True)  # switching paths must not repack the weights
    experts_mod.DENSE_TOKENS_PER_THREAD = 1 << 30 if path == "dense" else 0
    experts_mod.USE_FUSED_KERNEL = path == "fused"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the demo model)")
    ap.add_argument("--tokens", default="2,4,8,16,32,64,128")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--layers", type=int, default=8, help="expert layers cycled through (weights beyond the cache)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--routing", choices=["random", "even"], default="random",
                    help="top-k experts drawn uniformly, or every expert the same number of rows")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dense_default = experts_mod.DENSE_TOKENS_PER_THREAD
    model = ExpertModel.load(args.model or str(demo_model_path()), dtype="bfloat16")
    layers = [p for p in model.layers if p.expert_ids][: args.layers]
    num_experts, top_k = model.cfg.num_experts, model.cfg.top_k
    if not linear.packing_available():
        print("no oneDNN bf16 GEMM on this CPU: only the grouped path exists here")
    rows = []
    g = torch.Generator().manual_seed(0)
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for t in [int(x) for x in args.tokens.split(",")]:
            y = torch.randn(t, model.cfg.hidden_size, generator=g).to(torch.bfloat16)
            if args.routing == "even":
                ids = (torch.arange(t)[:, None] * top_k + torch.arange(top_k)[None, :]) % num_experts
            else:
                ids = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(t)])
            w = torch.softmax(torch.randn(t, top_k, generator=g), -1)
            times: dict[str, list[float]] = {p: [] for p in PATHS}
            with torch.inference_mode():
                for r in range(args.rounds + 1):
                    order = PATHS[r % len(PATHS):] + PATHS[: r % len(PATHS)]
                    for path in order:
                        _set_path(path)
                        t0 = time.perf_counter()
                        for part in layers:
                            part(y, ids, w)
                        if r:  # round 0 packs the weights and warms up
                            times[path].append((time.perf_counter() - t0) / len(layers) * 1e6)
            med = {p: statistics.median(v) for p, v in times.items()}
            rows.append({"threads": threads, "tokens": t, **{f"{p}_us": round(med[p], 1) for p in PATHS},
                         **{f"{p}_min_max_us": [round(min(times[p]), 1), round(max(times[p]), 1)] for p in PATHS}})
    _set_path("fused")
    experts_mod.DENSE_TOKENS_PER_THREAD = dense_default
    heads = lm_head_rows(args.model or str(demo_model_path()), [int(x) for x in args.tokens.split(",")],
                         [int(t) for t in args.threads.split(",")], args.rounds, g)
    print(f"expert layer, bf16, {len(layers)} layers cycled, {args.routing} routing, median us per layer over {args.rounds} rounds "
          f"(ratio to grouped); without the fused kernel ExpertPart runs dense for T <= {dense_default} x threads")
    print(f"{'threads':>7} {'T':>5} {'grouped':>9} " + " ".join(f"{p:>16}" for p in PATHS[1:]))
    for row in rows:
        g_us = row["grouped_us"]
        print(f"{row['threads']:>7} {row['tokens']:>5} {g_us:>9.0f} " + " ".join(
            f"{row[p + '_us']:>9.0f} ({g_us / row[p + '_us']:.2f}x)" for p in PATHS[1:]))
    print(f"LM head, bf16 weight [{heads[0]['vocab']}, {heads[0]['hidden']}], median us per call: float32 logits; "
          f"logits + argmax_rows; the greedy LM head (linear_argmax, no logits)")
    print(f"{'threads':>7} {'T':>5} {'logits':>9} {'GFLOP/s':>8} {'+argmax':>9} {'greedy':>9}")
    for row in heads:
        print(f"{row['threads']:>7} {row['tokens']:>5} {row['us']:>9.0f} {row['gflop_s']:>8.1f} {row['argmax_us']:>9.0f} "
              f"{row['greedy_us']:>9.0f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "linear_kernels", "dtype": "bfloat16", "rounds": args.rounds, "routing": args.routing,
                       "layers": len(layers), "dense_tokens_per_thread": dense_default, "rows": rows, "lm_head": heads}, f, indent=1)


def lm_head_rows(path: str, tokens: list[int], threads: list[int], rounds: int,
                 g: torch.Generator) -> list[dict]:
    """The LM head three ways, timed in alternating order each round: ``us`` its float32 logits
    (``model.linear.lm_head``: the kernel on its packed weight where it runs); ``argmax_us`` those
    logits and greedy sampling's ``argmax_rows`` over them; ``greedy_us`` the greedy LM head
    (``lm_head_argmax``: each row's best logit and its index, no logits written)."""
    cfg = ModelConfig.from_pretrained(path)
    w = read_lm_head(CheckpointReader(path), cfg, torch.bfloat16)
    vocab, hidden = w.shape
    rows = []
    with torch.inference_mode():
        for n in threads:
            torch.set_num_threads(n)
            for t in tokens:
                x = torch.randn(t, hidden, generator=g).to(torch.bfloat16)
                ways = {"us": lambda: linear.lm_head(x, w),
                        "argmax_us": lambda: argmax_rows(linear.lm_head(x, w)),
                        "greedy_us": lambda: linear.lm_head_argmax(x, w, Best(t))}
                for f in ways.values():
                    f()  # packs the weight once, warms up
                times: dict[str, list[float]] = {k: [] for k in ways}
                for r in range(rounds):
                    names = list(ways)[r % 3:] + list(ways)[: r % 3]
                    for k in names:
                        t0 = time.perf_counter()
                        ways[k]()
                        times[k].append(time.perf_counter() - t0)
                med = {k: statistics.median(v) for k, v in times.items()}
                rows.append({"threads": n, "tokens": t, "vocab": vocab, "hidden": hidden,
                             **{k: round(v * 1e6, 1) for k, v in med.items()},
                             "gflop_s": round(2 * t * vocab * hidden / med["us"] / 1e9, 1)})
    return rows


if __name__ == "__main__":
    main()
