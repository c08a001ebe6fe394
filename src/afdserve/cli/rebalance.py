"""``afdserve rebalance``: ask a running server to re-plan its expert placement from the recent load."""

from __future__ import annotations

import argparse

from afdserve.cli.admin_call import add_server_args, client, failed, print_placement


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("rebalance", help="re-plan a running server's expert placement",
                       description="POST /admin/rebalance: moves expert weights to a placement planned from the "
                                   "recent load (hot experts get replicas) while the server keeps serving.")
    add_server_args(p)
    p.add_argument("--slots-per-worker", type=int, default=None, help="expert slots per expert worker")
    p.add_argument("--planner", default="janus", choices=["janus", "megascale"])
    p.add_argument("--snapshot", default=None, metavar="PATH",
                   help="also save the load snapshot the plan came from (draw it with afdserve expert-load)")
    return p


def main(args: argparse.Namespace) -> int:
    with client(args, timeout=300) as c:
        if args.snapshot:
            r = c.get("/admin/expert-load")
            if r.status_code != 200:
                return failed("reading the expert load", r)
            with open(args.snapshot, "w") as f:
                f.write(r.text)
        r = c.post("/admin/rebalance", json={"slots_per_worker": args.slots_per_worker, "planner": args.planner})
    if r.status_code != 200:
        return failed("rebalance", r)
    body = r.json()
    print(f"expert map version {body['version']}")
    print_placement(body["experts_per_worker"])
    return 0
