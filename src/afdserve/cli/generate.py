"""``afdserve generate``: offline generation from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from afdserve.cli.deployment import add_engine_args, engine_config

DEFAULT_PROMPTS = ["The capital of France is", "Mixture-of-Experts models route each token to",
                   "def fibonacci(n):", "Once upon a time"]


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="generate text offline", description="Generate completions for prompts.")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable; default: 4 examples)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", default=None, help="also write the outputs as JSON to this path")
    add_engine_args(p)
    return p


def main(args: argparse.Namespace) -> int:
    from afdserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, ignore_eos=args.ignore_eos)
    cfg = engine_config(args)
    prompts = args.prompt or DEFAULT_PROMPTS
    with LLM(**dataclasses.asdict(cfg)) as llm:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    for o in outs:
        print(f"--- prompt: {o.prompt!r}\n{o.outputs[0].text!r}  [{len(o.outputs[0].token_ids)} tokens, "
              f"finish_reason={o.outputs[0].finish_reason}]")
    print(f"\n{len(outs)} prompts, {n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"prompt": o.prompt, "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
                        "finish_reason": o.outputs[0].finish_reason} for o in outs], f, indent=1)
    return 0
