"""Where a disaggregated decode's time goes (1 attention + 1 expert worker, m lanes of steps).

Runs the deployment with ``--trace`` on the demo model (bf16, random token-id prompts, greedy, EOS
ignored), one warm-up and one traced generate per batch size, then splits the decode window of each
worker into its kinds of work, per step of the whole batch (``afdserve.runtime.trace_steps``): the
attention worker's layers, LM head (its share), combines, sends, engine (scheduling, sampling,
outputs), waiting for replies (blocked) and the rest (the lanes' Python between spans); the expert
worker's MoE layers, LM head share, sends
and idle time; then who waits on whom (``trace_steps.idle_beside``): each worker's idle time split by
what the other worker did meanwhile.

    python benchmarks/step_trace.py [--batches 64,256] [--threads 1] [--micro-batches 2] [--compile]
                                    [--no-lend-idle-cores]
                                    [--json out/step_trace.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile

import torch

from afdserve import LLM, SamplingParams
from afdserve.model.demo import demo_model_path
from afdserve.runtime.trace_plot import load
from afdserve.runtime.trace_steps import breakdown, idle_beside

COLUMNS = [("step_ms", "step"), ("attention_layers_ms", "attn layers"), ("lm_head_ms", "attn LM head"),
           ("send_ms", "attn send"), ("engine_ms", "engine"), ("wait_ms", "attn wait"),
           ("other_ms", "attn other"),
           ("expert_busy_ms", "expert MoE"), ("expert_send_ms", "expert send"),
           ("expert_idle_ms", "expert idle")]


def run(batch: int, new_tokens: int, args: argparse.Namespace) -> dict:
    path = os.path.join(tempfile.mkdtemp(prefix="afdserve-step-trace-"), "trace.json")
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    llm = LLM(args.model or str(demo_model_path()), dtype="bfloat16", num_threads=args.threads, max_num_seqs=batch,
              max_num_batched_tokens=max(2048, batch * args.prompt_len), max_model_len=args.prompt_len + new_tokens + 1,
              expert_workers=1, micro_batches=args.micro_batches, compile=args.compile, trace=path,
              lend_idle_cores=not args.no_lend_idle_cores, device=args.device)
    rng = random.Random(batch)
    top = min(30000, llm.engine.vocab_size)  # token ids any vocabulary holds
    prompts = [{"prompt_token_ids": [rng.randrange(100, top) for _ in range(args.prompt_len)]} for _ in range(batch)]
    try:
        llm.generate(prompts, params)  # warm-up (and compilation)
        llm.generate(prompts, params)
    finally:
        llm.shutdown()
    spans = load(path)
    b = breakdown(spans, "attention0", "expert0", batch)
    return {"batch": batch, "new_tokens": new_tokens, **b.to_json(), "tok_per_s_from_steps": round(batch / b.step_ms * 1e3),
            "idle_beside": idle_beside(spans, "attention0", "expert0", batch)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model folder (default: the demo model)")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--no-lend-idle-cores", action="store_true",
                    help="the expert worker borrows no core (as benchmarks/pingpong.py runs by default)")
    ap.add_argument("--device", default="cpu", help="the workers' device (cuda: both on the one GPU)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the front end only detokenizes
    rows = [run(int(b), args.new_tokens, args) for b in args.batches.split(",")]
    print(f"1 attention + 1 expert worker, m={args.micro_batches}, {args.threads} thread(s) each, bf16, {args.device}"
          f"{', compiled' if args.compile else ''}: ms per decode step of the whole batch (its lanes overlap)")
    print(f"{'batch':>6} " + " ".join(f"{title:>17}" for _, title in COLUMNS))
    for r in rows:
        print(f"{r['batch']:>6} " + " ".join(f"{r[k]:>17.2f}" for k, _ in COLUMNS))
    print("who waits on whom: each worker's time outside its spans, by what the other did meanwhile "
          "(ms per decode step; idle: both)")
    for r in rows:
        for w, split in r["idle_beside"].items():
            print(f"{r['batch']:>6} {w:>10} idle beside: " + ", ".join(f"{k} {v:.2f}" for k, v in split.items()))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "step_trace", "device": args.device, "micro_batches": args.micro_batches,
                       "threads": args.threads,
                       "compile": args.compile,
                       "lend_idle_cores": not args.no_lend_idle_cores, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
