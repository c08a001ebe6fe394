"""What a call costs right after an expert layer: the caches the decode hot path finds.

One expert layer of the demo model streams about 12 MB of weights through a core's 1 MiB L2 and the
shared L3, so whatever runs next on that core finds little of its own state (interpreter, dispatcher,
kernel code, small tensors) in the caches. This times a few calls of the hot path on one thread,
warm (the same call repeated) and right after a decode-sized expert layer (32 tokens, the fused
MoE kernel, a different layer each time, as the pipeline runs them), and the LM head in one call
against pieces of it (``runtime.pipeline`` computes it in pieces between other work). Medians.

    python benchmarks/cold_calls.py [--repeats 40] [--json out/cold_calls.json]
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
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=32, help="token rows of the expert layers and the LM head")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from afdserve.engine.host_memory import keep_freed_memory
    from afdserve.model.demo import demo_model_path
    from afdserve.model.greedy import Best
    from afdserve.model.linear import lm_head_argmax
    from afdserve.model.model import AttentionModel, ExpertModel

    keep_freed_memory()  # as the engine's processes run
    torch.set_num_threads(1)  # one worker's core
    path = str(demo_model_path())
    model = ExpertModel.load(path, dtype="bfloat16")
    experts = [p for p in model.layers if p.expert_ids]
    lm = AttentionModel.load(path, dtype="bfloat16").lm_head.weight
    e, k, h, n = model.cfg.num_experts, model.cfg.top_k, lm.shape[1], args.tokens
    g = torch.Generator().manual_seed(0)
    y = torch.randn(n, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    w = torch.softmax(torch.randn(n, k, generator=g), -1)
    xn = torch.randn(n, h, generator=g).to(torch.bfloat16)
    vocab, tiny, best = lm.shape[0], torch.ones(4), Best(n, xn.device)
    calls = {
        "torch add of 4 floats": lambda: tiny.add(1.0),
        "LM head, one block of 32 rows (a kernel call)": lambda: lm_head_argmax(xn, lm, best, 0, 32),
        "expert layer (the first one)": lambda: experts[0](y, ids, w),
    }
    pieces = [vocab, 4096, 1024]
    layer = [0]

    def expert_layer() -> None:  # the next layer's weights, as the pipeline's expert worker goes
        layer[0] = (layer[0] + 1) % len(experts)
        experts[layer[0]](y, ids, w)

    def expert_step() -> None:  # every expert layer once: a decode step's weights through the caches
        for _ in experts:
            expert_layer()

    before = {"warm": lambda: None, "after one": expert_layer, "after a step": expert_step}

    rows = []
    with torch.inference_mode():
        for name, fn in calls.items():
            fn()
            t: dict[str, list[float]] = {cond: [] for cond in before}
            for _ in range(args.repeats):
                for cond, prepare in before.items():
                    prepare()
                    t0 = time.perf_counter()
                    fn()
                    t[cond].append(time.perf_counter() - t0)
            rows.append({"call": name, **{cond: statistics.median(v) * 1e6 for cond, v in t.items()}})
        lm_rows = []
        for piece in pieces:
            t = {cond: [] for cond in before}
            for _ in range(max(5, args.repeats // 4)):
                for cond, prepare in before.items():
                    total = 0.0
                    for s in range(0, vocab, piece):  # each piece after the condition's expert layers
                        prepare()
                        b = Best(n, xn.device)
                        t0 = time.perf_counter()
                        lm_head_argmax(xn, lm, b, s, min(vocab, s + piece))
                        total += time.perf_counter() - t0
                    t[cond].append(total)
            lm_rows.append({"piece_rows": piece, **{cond: statistics.median(v) * 1e3 for cond, v in t.items()}})
    print(f"one thread, bf16, {n} token rows, medians: each call warm (repeated), right after one expert layer, "
          f"and right after a decode step's {len(experts)} expert layers")
    heads = "".join(f"{c:>14}" for c in before)
    print(f"{'call (us)':<48}{heads}")
    for r in rows:
        print(f"{r['call']:<48}" + "".join(f"{r[c]:>14.1f}" for c in before))
    print(f"the LM head ({vocab} x {h}) in pieces, each after the same (ms for the whole vocabulary)")
    print(f"{'piece (vocabulary rows)':<48}{heads}")
    for r in lm_rows:
        print(f"{r['piece_rows']:<48}" + "".join(f"{r[c]:>14.3f}" for c in before))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "cold_calls", "tokens": n, "repeats": args.repeats, "calls": rows,
                       "lm_head_pieces": lm_rows}, f, indent=1)


if __name__ == "__main__":
    main()
