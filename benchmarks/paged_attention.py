"""The paged attention kernel on decode batches: µs per call and the KV bytes it reads per second.

Each shape has 8 layers' caches (so the keys come from memory, not cache), sequences' blocks spread
at random over the cache, one query token per sequence; rounds over the 8 layers, median.

    python benchmarks/paged_attention.py [--threads 1,2] [--json out/paged_attention.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

# (kv heads, sequences, context): the ping-pong benchmark's model (8 KV heads) and the demo model's
SHAPES = [(8, 256, 70), (2, 64, 64), (2, 128, 64), (2, 256, 48)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--json", default="out/paged_attention.json")
    args = ap.parse_args()
    from afdserve import kernels
    from afdserve.kernels.attention import paged_attention

    kernels.load()
    bf, bs, hd, nh = torch.bfloat16, 16, 32, 8
    g = torch.Generator().manual_seed(0)
    rows = []
    for nkv, s, ctx in SHAPES:
        nblk = s * 8
        layers = [(torch.randn(nblk * bs, nkv, hd, generator=g).to(bf), torch.randn(nblk * bs, nkv, hd, generator=g).to(bf))
                  for _ in range(8)]
        nb = -(-ctx // bs)
        perm = torch.randperm(nblk, generator=g)
        tables = torch.stack([perm[i * nb:(i + 1) * nb] for i in range(s)]).int()
        kv_lens = torch.full((s,), ctx, dtype=torch.int32)
        cu_q = torch.arange(s + 1, dtype=torch.int32)
        q = torch.randn(s, nh, hd, generator=g).to(bf)
        mb = s * ctx * nkv * hd * 2 * 2 / 1e6  # keys and values read
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)

            def run() -> None:
                for kc, vc in layers:
                    paged_attention(q, kc, vc, tables, kv_lens, cu_q, bs, 0, hd ** -0.5)

            run()
            times = []
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                run()
                times.append((time.perf_counter() - t0) / len(layers) * 1e6)
            us = statistics.median(times)
            rows.append({"kv_heads": nkv, "heads": nh, "head_dim": hd, "seqs": s, "context": ctx, "threads": threads,
                         "us": round(us, 1), "kv_mb": round(mb, 2), "gb_per_s": round(mb / us * 1e3, 2)})
            print(f"kv heads {nkv}, {s:>4} seqs x {ctx} keys, {threads} thread(s): {us:8.0f} us/call, "
                  f"{mb:5.1f} MB of KV -> {mb / us * 1e3:5.1f} GB/s")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "paged_attention", "dtype": "bfloat16", "block_size": bs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
