"""Ping-pong pipeline benchmark on the demo model (expert weights dominate, so experts are
memory-bound at small batch), all deployments measured side by side in one run:

  1. micro-batches m = 1..4 with one attention and one expert worker (MegaScale-Infer Fig. 14)
  2. n_a = 1..k attention workers in front of fixed expert workers (Fig. 15)
  3. colocated against disaggregated on the same number of cores (Fig. 13)

Decode throughput excludes prefill: (time for N tokens - time for 1 token) per generated token.
Each worker process uses one thread; the colocated engine uses as many threads as the
disaggregated deployment has processes.

    python benchmarks/pingpong.py [--batch 64] [--tokens 48] [--json out/pingpong.json] [--trace-dir out]
                                  [--cluster ray [--ray-address ADDRESS]]

With ``--cluster ray`` the disaggregated deployments run as Ray actors (attention workers on nodes
with the ``attention_node`` resource, expert workers on ``expert_node`` nodes; docs/ray.md).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch


def measure(kw: dict, batch: int, tokens: int, prompt_len: int, vocab: int, repeats: int,
            trace: str | None = None) -> dict:
    from afdserve import LLM, SamplingParams

    if trace:
        kw = dict(kw, trace=trace)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]} for _ in range(batch)]
    with LLM(None, max_num_seqs=batch, **kw) as llm:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # warm-up

        def run(n: int) -> float:
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                best = min(best, time.perf_counter() - t0)
            return best

        t1, tn = run(1), run(tokens)
        usage = None
        if trace:
            from afdserve.runtime.trace_plot import load, usage as usage_of

            llm.engine.collect("trace")  # drop the spans of the runs above
            llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
            llm.engine.write_trace(trace)
            usage = {u.worker: u.busy for u in usage_of(load(trace))}
    tbt = (tn - t1) / (tokens - 1)
    return {"tbt_ms": tbt * 1e3, "decode_tok_s": batch / tbt, "busy": usage}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64, help="concurrent sequences per attention worker")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-attention-workers", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default="out/pingpong.json")
    ap.add_argument("--trace-dir", default="out")
    ap.add_argument("--only", default="m,na,coloc", help="which comparisons to run")
    ap.add_argument("--cluster", default="local", choices=["local", "ray"],
                    help="disaggregated deployments as local processes or Ray actors (docs/ray.md)")
    ap.add_argument("--ray-address", default=None, help="--cluster ray: the Ray cluster to join")
    args = ap.parse_args()
    if args.cluster == "ray":
        import ray

        ray.init(address=args.ray_address)  # once: every deployment below joins this connection
    os.makedirs(args.trace_dir, exist_ok=True)
    from afdserve.model.config import ModelConfig
    from afdserve.model.demo import demo_model_path

    vocab = ModelConfig.from_pretrained(demo_model_path()).vocab_size
    one = dict(num_threads=1, kv_cache_gb=0.5)
    res: dict = {"batch": args.batch, "tokens": args.tokens, "cores": os.cpu_count()}

    def go(name: str, kw: dict, batch: int, trace: bool = False) -> dict:
        path = os.path.join(args.trace_dir, f"trace_{name}.json") if trace else None
        if args.cluster == "ray" and kw.get("expert_workers", 0) > 0:
            kw = dict(kw, cluster="ray")
        r = measure(kw, batch, args.tokens, args.prompt_len, vocab, args.repeats, path)
        r["trace"] = path
        busy = "" if not r["busy"] else "  busy " + ", ".join(f"{k} {v:.0%}" for k, v in r["busy"].items())
        print(f"  {name:<28} {r['decode_tok_s']:>8.1f} tok/s  TBT {r['tbt_ms']:>7.2f} ms{busy}", flush=True)
        return r

    if "m" in args.only:
        print("1. micro-batches (1 attention + 1 expert worker, 1 thread each)")
        res["micro_batches"] = {m: go(f"a1_e1_m{m}", dict(expert_workers=1, micro_batches=m, **one), args.batch,
                                      trace=True) for m in (1, 2, 3, 4)}
        base = res["micro_batches"][1]["decode_tok_s"]
        for m, r in res["micro_batches"].items():
            r["speedup_vs_m1"] = r["decode_tok_s"] / base
        print("   speed-up over m=1: " + ", ".join(f"m={m}: {r['speedup_vs_m1']:.2f}x"
                                                   for m, r in res["micro_batches"].items()))
    if "na" in args.only:
        print("2. attention workers in front of 1 expert worker (m=2, same batch per attention worker)")
        res["attention_workers"] = {
            n: go(f"a{n}_e1_m2", dict(attention_workers=n, expert_workers=1, micro_batches=2, **one),
                  args.batch * n) for n in range(1, args.max_attention_workers + 1)}
    if "coloc" in args.only:
        print("3. colocated vs disaggregated on 2 cores")
        res["colocated_vs_disaggregated"] = {
            "colocated_2_threads": go("colocated", dict(num_threads=2, kv_cache_gb=0.5), args.batch),
            "disaggregated_a1_e1_m2": go("disagg", dict(expert_workers=1, micro_batches=2, **one), args.batch),
        }
        c = res["colocated_vs_disaggregated"]
        c["ratio"] = c["disaggregated_a1_e1_m2"]["decode_tok_s"] / c["colocated_2_threads"]["decode_tok_s"]
        print(f"   disaggregated / colocated throughput: {c['ratio']:.2f}x")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
