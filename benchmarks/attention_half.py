"""The attention half of a decode layer (``AttentionModel.pre_moe``): one ``attention_half`` kernel
call against the same kernels called one by one from Python, µs per layer.

The demo model (bf16), one thread, a decode batch of ``--seqs`` sequences with ``--context`` keys
each in a paged cache whose blocks are spread at random; every round runs all layers both ways,
in alternating order; medians over rounds. The outputs of both ways are checked bit for bit.

    python benchmarks/attention_half.py [--seqs 32,128] [--context 64] [--rounds 15]
                                        [--json out/attention_half.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="32,128", help="decode batch sizes (one micro-batch of the 1+1 deployment)")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="out/attention_half.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from afdserve import kernels
    from afdserve.kvcache.cache import KVCache
    from afdserve.model.attention import AttentionPart, AttnMetadata
    from afdserve.model.demo import demo_model_path
    from afdserve.model.model import AttentionModel

    if not kernels.supports("attention_half", torch.zeros(1, dtype=torch.bfloat16)):
        raise SystemExit("no attention_half kernel for bfloat16 here")
    model = AttentionModel.load(demo_model_path(), "bfloat16")
    cfg, bs = model.cfg, 16
    fused = AttentionPart.fused
    rows = []
    for s in [int(x) for x in args.seqs.split(",")]:
        nb = -(-args.context // bs)
        g = torch.Generator().manual_seed(s)
        perm = torch.randperm(s * nb, generator=g).view(s, nb).tolist()
        meta = AttnMetadata.from_blocks([1] * s, [args.context] * s, perm, bs).to(torch.device("cpu"), model.windows)
        kv = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, s * nb, bs, torch.bfloat16)
        kv.k.normal_(generator=g)
        kv.v.normal_(generator=g)
        x = torch.randn(s, cfg.hidden_size, generator=g).to(torch.bfloat16)
        cos_sin = model.rotary.cos_sin(meta.positions, model.dtype)

        def layers(one_call: bool) -> list:
            AttentionPart.fused = fused if one_call else (lambda *a, **k: None)
            try:
                return [model.pre_moe(layer, x, cos_sin, meta, kv) for layer in range(cfg.num_layers)]
            finally:
                AttentionPart.fused = fused

        with torch.inference_mode():
            a, b = layers(True), layers(False)
            same = all(torch.equal(u, v) for ra, rb in zip(a, b) for u, v in zip(ra, rb) if u is not None)
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds):
                for one_call in ((True, False) if r % 2 == 0 else (False, True)):
                    t0 = time.perf_counter()
                    layers(one_call)
                    times[one_call].append((time.perf_counter() - t0) / cfg.num_layers * 1e6)
        fused_us, split_us = statistics.median(times[True]), statistics.median(times[False])
        rows.append({"seqs": s, "context": args.context, "threads": args.threads, "fused_us": round(fused_us, 1),
                     "call_by_call_us": round(split_us, 1), "ratio": round(split_us / fused_us, 3), "identical": same})
        print(f"{s:>4} sequences x {args.context} keys: one call {fused_us:7.1f} us/layer, call by call "
              f"{split_us:7.1f} us/layer ({split_us / fused_us:.2f}x), outputs identical: {'yes' if same else 'NO'}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "attention_half", "dtype": "bfloat16", "block_size": bs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
