"""Where a colocated decode's CPU time goes: ``torch.profiler`` over one ``generate`` call.

The demo model in bf16 (or ``--model``), random token-id prompts, greedy, EOS ignored, after one
warm-up call; prints the operators with the most self CPU time and writes them as JSON.

    python benchmarks/decode_profile.py [--batch 8] [--new-tokens 64] [--threads 2] [--compile]
                                        [--rows 15] [--json out/decode_profile.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random

from torch.profiler import ProfilerActivity, profile

from afdserve import LLM, SamplingParams
from afdserve.model.demo import demo_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the demo model)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--rows", type=int, default=15)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    llm = LLM(args.model or str(demo_model_path()), dtype="bfloat16", num_threads=args.threads,
              max_num_seqs=args.batch, max_model_len=args.prompt_len + args.new_tokens + 1, compile=args.compile)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)

    def prompts() -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(100, 30000) for _ in range(args.prompt_len)]}
                for _ in range(args.batch)]

    llm.generate(prompts(), params)  # warm-up (packing, compilation)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts(), params)
    llm.shutdown()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    rows = [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2),
             "share": round(e.self_cpu_time_total / total, 4)} for e in events[: args.rows]]
    print(f"colocated decode, batch {args.batch}, {args.new_tokens} new tokens, {args.threads} threads, bf16"
          f"{', compiled' if args.compile else ''}: self CPU time {total / 1e3:.0f} ms")
    print(f"{'operator':<58} {'calls':>7} {'self ms':>9} {'share':>7}")
    for r in rows:
        print(f"{r['op'][:58]:<58} {r['calls']:>7} {r['self_ms']:>9.1f} {r['share']:>7.1%}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "decode_profile", "batch": args.batch, "threads": args.threads,
                       "compile": args.compile, "self_cpu_ms": round(total / 1e3, 1), "top": rows}, f, indent=1)


if __name__ == "__main__":
    main()
