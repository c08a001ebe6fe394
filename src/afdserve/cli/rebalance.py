"""``afdserve rebalance``: ask a running server to re-plan its expert placement from the recent load."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("rebalance", help="re-plan a running server's expert placement",
                       description="POST /admin/rebalance: moves expert weights to a placement planned from the "
                                   "recent load (hot experts get replicas) while the server keeps serving.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server (with `serve --admin-port PORT`: http://127.0.0.1:PORT)")
    p.add_argument("--admin-token", default=None, metavar="TOKEN",
                   help="the server's admin token (default: $AFDSERVE_ADMIN_TOKEN)")
    p.add_argument("--slots-per-worker", type=int, default=None, help="expert slots per expert worker")
    p.add_argument("--planner", default="janus", choices=["janus", "megascale"])
    p.add_argument("--snapshot", default=None, metavar="PATH",
                   help="also save the load snapshot the plan came from (draw it with afdserve expert-load)")
    return p


def main(args: argparse.Namespace) -> int:
    import httpx

    base = args.base_url.rstrip("/")
    token = args.admin_token or os.environ.get("AFDSERVE_ADMIN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(timeout=300, headers=headers) as c:
        if args.snapshot:
            r = c.get(f"{base}/admin/expert-load")
            if r.status_code != 200:
                return failed("reading the expert load", r)
            with open(args.snapshot, "w") as f:
                f.write(r.text)
        r = c.post(f"{base}/admin/rebalance", json={"slots_per_worker": args.slots_per_worker,
                                                     "planner": args.planner})
    if r.status_code != 200:
        return failed("rebalance", r)
    body = r.json()
    print(f"expert map version {body['version']}")
    for w, layers in enumerate(body["experts_per_worker"]):
        print(f"  expert{w}: layer 0 holds {layers[0]}" + (f" ... ({len(layers)} layers)" if len(layers) > 1 else ""))
    return 0


def failed(what: str, r: "httpx.Response") -> int:
    """Prints why an admin call failed (with a hint for 401/404); returns the exit status."""
    try:
        message = r.json().get("error", {}).get("message", r.text)
    except ValueError:
        message = r.text
    hint = {401: " (pass --admin-token or set AFDSERVE_ADMIN_TOKEN)",
            404: " (does the server serve admin endpoints? see --admin-token / --admin-port of afdserve serve)"}
    print(f"{what} failed ({r.status_code}): {message}{hint.get(r.status_code, '')}")
    return 1
