"""``afdserve bench cp``: context-parallel prefill's time to first token, CP = 2 against CP = 1 (afdserve.bench.cp)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("cp", help="context-parallel prefill: time to first token of a long prompt, CP=2 vs CP=1",
                       description="A prompt of N tokens on 2 attention workers + expert workers, CP = 1 (one "
                                   "attention worker prefills it) and CP = 2 (split over both, ring attention), in "
                                   "paired rounds alternating which goes first; prints each round's ratio, the "
                                   "median, and the ideal ratio from the CP = 1 run's traced split of attention "
                                   "and expert time.")
    p.add_argument("--model", default=None, help="model folder (default: the demo model, its context raised as needed)")
    p.add_argument("--tokens", type=int, default=16384, help="prompt length (default 16384)")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds (default 3)")
    p.add_argument("--decode", type=int, default=0, metavar="D",
                   help="also generate D tokens after the first and time them per token: CP=1, CP=2 gathered and a "
                        "third deployment, CP=2 with the KV kept sharded (--cp-kv shard); default 0: prefill only")
    p.add_argument("--expert-workers", type=int, default=1)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p


def main(args: argparse.Namespace) -> int:
    from afdserve.bench.cp import measure, report

    if args.tokens < 64 or args.rounds < 1 or args.expert_workers < 1 or args.decode < 0:
        raise SystemExit("afdserve bench cp: --tokens must be >= 64, --rounds and --expert-workers >= 1, --decode >= 0")
    res = measure(args.model, args.tokens, args.rounds, args.expert_workers, args.num_threads, args.decode)
    print(report(res))
    if args.json:
        args.json.write_text(json.dumps({"tokens": res.tokens, "rounds": [asdict(r) | {"ratio": r.ratio}
                                                                             for r in res.rounds],
                                         "median_ratio": res.ratio, "ideal_ratio": res.ideal,
                                         "attention_s": res.attention_s, "expert_s": res.expert_s,
                                         "decode": args.decode}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
