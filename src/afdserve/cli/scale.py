"""``afdserve scale``: resize a running server's attention and/or expert pool while it serves."""

from __future__ import annotations

import argparse
import os

from afdserve.cli.rebalance import failed


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("scale", help="add or remove attention / expert workers of a running server",
                       description="POST /admin/scale: starts or stops workers while the server keeps serving; "
                                   "on an expert-pool change the balance planner re-places the experts, and a "
                                   "removed attention worker's requests move to the others. No request fails.")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server (with `serve --admin-port PORT`: http://127.0.0.1:PORT)")
    p.add_argument("--admin-token", default=None, metavar="TOKEN",
                   help="the server's admin token (default: $AFDSERVE_ADMIN_TOKEN)")
    p.add_argument("--attention-workers", type=int, default=None, metavar="N",
                   help="attention workers wanted (default: unchanged)")
    p.add_argument("--expert-workers", type=int, default=None, metavar="N",
                   help="expert workers wanted (default: unchanged)")
    return p


def main(args: argparse.Namespace) -> int:
    import httpx

    base = args.base_url.rstrip("/")
    token = args.admin_token or os.environ.get("AFDSERVE_ADMIN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    body = {k: v for k, v in (("attention_workers", args.attention_workers),
                              ("expert_workers", args.expert_workers)) if v is not None}
    with httpx.Client(timeout=600, headers=headers) as c:
        r = c.post(f"{base}/admin/scale", json=body)
    if r.status_code != 200:
        return failed("scale", r)
    res = r.json()
    print(f"{res['attention_workers']} attention + {res['expert_workers']} expert workers "
          f"(membership epoch {res['epoch']}, expert map version {res['map_version']}, ready in {res['seconds']:.1f} s)")
    for w, layers in enumerate(res["experts_per_worker"]):
        print(f"  expert{w}: layer 0 holds {layers[0]}" + (f" ... ({len(layers)} layers)" if len(layers) > 1 else ""))
    return 0
