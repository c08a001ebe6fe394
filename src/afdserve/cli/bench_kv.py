"""``afdserve bench kv``: how the FP8 KV cache changes next-token distributions (afdserve.bench.kv_quality)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("kv", help="greedy agreement and KL of the FP8 KV cache against float32 and bfloat16",
                       description="Holdout prompts through the model in float32 with a float32 KV cache (the "
                                   "reference), in bfloat16 (its KV cache bfloat16) and in float32 with the fp8_e4m3 "
                                   "KV cache, teacher-forced on the reference's greedy tokens; per pair, the greedy "
                                   "agreement and the mean KL of the next-token distributions.")
    p.add_argument("--model", default=None, help="model folder (default: the demo model)")
    p.add_argument("--max-tokens", type=int, default=32, help="generated positions per prompt (default 32)")
    p.add_argument("--backend", default="auto", choices=["auto", "cpu", "torch", "triton"],
                   help="the hot path's backends (as in serve; fp8 attends on torch or triton)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p


def main(args: argparse.Namespace) -> int:
    from afdserve.bench.kv_quality import HOLDOUT_PROMPTS, kv_quality, report

    if args.max_tokens < 1:
        raise SystemExit("afdserve bench kv: --max-tokens must be >= 1")
    rows = kv_quality(args.model, args.max_tokens, args.backend)
    print(f"{len(HOLDOUT_PROMPTS)} holdout prompts x {args.max_tokens} positions, model "
          f"{args.model or 'demo'}, backend {args.backend}")
    print(report(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
