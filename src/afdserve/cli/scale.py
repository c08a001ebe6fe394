"""``afdserve scale``: resize a running server's attention and/or expert pool while it serves."""

from __future__ import annotations

import argparse

from afdserve.cli.admin_call import add_server_args, client, failed, print_placement


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("scale", help="add or remove attention / expert workers of a running server",
                       description="POST /admin/scale: starts or stops workers while the server keeps serving; "
                                   "on an expert-pool change the balance planner re-places the experts, and a "
                                   "removed attention worker's requests move to the others. No request fails.")
    add_server_args(p)
    p.add_argument("--attention-workers", type=int, default=None, metavar="N",
                   help="attention workers wanted (default: unchanged)")
    p.add_argument("--expert-workers", type=int, default=None, metavar="N",
                   help="expert workers wanted (default: unchanged)")
    return p


def main(args: argparse.Namespace) -> int:
    body = {k: v for k, v in (("attention_workers", args.attention_workers),
                              ("expert_workers", args.expert_workers)) if v is not None}
    with client(args, timeout=600) as c:
        r = c.post("/admin/scale", json=body)
    if r.status_code != 200:
        return failed("scale", r)
    res = r.json()
    print(f"{res['attention_workers']} attention + {res['expert_workers']} expert workers "
          f"(membership epoch {res['epoch']}, expert map version {res['map_version']}, ready in {res['seconds']:.1f} s)")
    print_placement(res["experts_per_worker"])
    return 0
