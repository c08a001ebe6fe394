"""``afdserve rebalance``: ask a running server to re-plan its expert placement from the recent load."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("rebalance", help="re-plan a running server's expert placement",
                       description="POST /admin/rebalance: moves expert weights to a placement planned from the "
                                   "recent load (hot experts get replicas) while the server keeps serving.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--slots-per-worker", type=int, default=None, help="expert slots per expert worker")
    p.add_argument("--planner", default="janus", choices=["janus", "megascale"])
    p.add_argument("--snapshot", default=None, metavar="PATH",
                   help="also save the load snapshot the plan came from (draw it with afdserve expert-load)")
    return p


def main(args: argparse.Namespace) -> int:
    import httpx

    base = args.base_url.rstrip("/")
    with httpx.Client(timeout=300) as c:
        if args.snapshot:
            r = c.get(f"{base}/admin/expert-load")
            r.raise_for_status()
            with open(args.snapshot, "w") as f:
                f.write(r.text)
        r = c.post(f"{base}/admin/rebalance", json={"slots_per_worker": args.slots_per_worker,
                                                     "planner": args.planner})
    if r.status_code != 200:
        print(f"rebalance failed ({r.status_code}): {r.json().get('error', {}).get('message', r.text)}")
        return 1
    body = r.json()
    print(f"expert map version {body['version']}")
    for w, layers in enumerate(body["experts_per_worker"]):
        print(f"  expert{w}: layer 0 holds {layers[0]}" + (f" ... ({len(layers)} layers)" if len(layers) > 1 else ""))
    return 0
