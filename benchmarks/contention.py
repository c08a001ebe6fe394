"""How much one core's expert layer slows down when the other core streams memory (what the two
workers of a 1 + 1 disaggregated deployment do to each other on one socket).

One expert layer of the demo model (fused MoE kernel, bf16, one thread, 8 layers cycled so weights
come from memory) timed alone, next to a process that keeps the other core busy with arithmetic,
and next to one that streams a 256 MiB buffer; rounds alternate the three, medians.

    python benchmarks/contention.py [--tokens 32,128] [--rounds 5] [--json out/contention.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

NEIGHBOR = """
import sys, torch
torch.set_num_threads(1)
x = torch.ones(64 * 1024 * 1024)
sys.stdout.write("ready\\n"); sys.stdout.flush()
while True:
    if sys.argv[1] == "memory":
        x.sum()
    else:
        s = 0
        for i in range(100000):
            s += i
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="32,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from afdserve.model.demo import demo_model_path
    from afdserve.model.model import ExpertModel

    torch.set_num_threads(1)
    model = ExpertModel.load(str(demo_model_path()), dtype="bfloat16")
    layers = [p for p in model.layers if p.expert_ids]
    g = torch.Generator().manual_seed(0)
    e, k = model.cfg.num_experts, model.cfg.top_k
    results = []
    for t in [int(x) for x in args.tokens.split(",")]:
        y = torch.randn(t, model.cfg.hidden_size, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
        w = torch.softmax(torch.randn(t, k, generator=g), -1)
        times: dict[str, list[float]] = {"alone": [], "arithmetic": [], "memory": []}
        with torch.inference_mode():
            for part in layers:
                part(y, ids, w)  # packs the weights
            for r in range(args.rounds):
                for neighbor in list(times)[r % 3:] + list(times)[: r % 3]:
                    proc = None
                    if neighbor != "alone":
                        proc = subprocess.Popen([sys.executable, "-c", NEIGHBOR, neighbor], stdout=subprocess.PIPE,
                                                text=True)
                        proc.stdout.readline()  # it runs
                    try:
                        t0 = time.perf_counter()
                        for _ in range(5):
                            for part in layers:
                                part(y, ids, w)
                        times[neighbor].append((time.perf_counter() - t0) / (5 * len(layers)) * 1e6)
                    finally:
                        if proc is not None:
                            proc.kill()
                            proc.wait()
        med = {n: statistics.median(v) for n, v in times.items()}
        results.append({"tokens": t, **{f"{n}_us": round(v, 1) for n, v in med.items()}})
        print(f"T={t:>4}: alone {med['alone']:7.0f} us, next to arithmetic {med['arithmetic']:7.0f} us "
              f"({med['arithmetic'] / med['alone']:.2f}x), next to a memory stream {med['memory']:7.0f} us "
              f"({med['memory'] / med['alone']:.2f}x) per expert layer")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "contention", "rounds": args.rounds, "rows": results}, f, indent=1)


if __name__ == "__main__":
    main()
