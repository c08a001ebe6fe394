"""``afdserve bench pd``: prefill/decode disaggregation's KV transfer tail and decode gaps (afdserve.bench.pd)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("pd", help="prefill/decode disaggregation: the KV transfer's tail and decode gaps",
                       description="With 1 prefill + 1 decode attention worker: how long after the prefill's last "
                                   "layer the decode worker holds every layer's KV, as a share of the prefill's time, "
                                   "per prompt length; and the inter-token gaps of decode streams while long prompts "
                                   "arrive, beside the single pool of 2 mixed attention workers.")
    p.add_argument("--model", default=None, help="model folder (default: the demo model, its context raised as needed)")
    p.add_argument("--lengths", default="4096,16384", help="prompt lengths of the transfer measurement")
    p.add_argument("--rounds", type=int, default=1, help="prompts per length (default 1)")
    p.add_argument("--gap-prompt-tokens", type=int, default=4096,
                   help="length of the long prompts that arrive while streams decode (0: skip the gaps)")
    p.add_argument("--long-prompts", type=int, default=2)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--expert-workers", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the prefill's chunk (token budget)")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    return p


def main(args: argparse.Namespace) -> int:
    from afdserve.bench.pd import decode_gaps, report, transfer_tail

    try:
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"afdserve bench pd: --lengths must be comma-separated integers, got {args.lengths!r}")
    if any(n < 1 for n in lengths) or args.rounds < 1 or args.gap_prompt_tokens < 0:
        raise SystemExit("afdserve bench pd: lengths and --rounds must be >= 1, --gap-prompt-tokens >= 0")
    common = dict(expert_workers=args.expert_workers, budget=args.max_num_batched_tokens, threads=args.num_threads)
    transfers = transfer_tail(args.model, lengths, args.rounds, **common) if lengths else []
    gaps = decode_gaps(args.model, args.gap_prompt_tokens, args.long_prompts, args.streams, args.stream_tokens,
                       **common) if args.gap_prompt_tokens else []
    print(report(transfers, gaps))
    if args.json:
        args.json.write_text(json.dumps({"transfers": [asdict(t) | {"share": t.share} for t in transfers],
                                         "gaps": [asdict(g) for g in gaps]}, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0
