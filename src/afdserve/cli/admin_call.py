"""What the commands that call a running server's admin endpoints share: the server and token
options, an authenticated client, the error report, and how an expert placement is printed."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server (with `serve --admin-port PORT`: http://127.0.0.1:PORT)")
    p.add_argument("--admin-token", default=None, metavar="TOKEN",
                   help="the server's admin token (default: $AFDSERVE_ADMIN_TOKEN)")


def client(args: argparse.Namespace, timeout: float) -> "httpx.Client":
    """A client of the server ``args`` names, with its admin token (``base_url`` set)."""
    import httpx

    token = args.admin_token or os.environ.get("AFDSERVE_ADMIN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=args.base_url.rstrip("/"), timeout=timeout, headers=headers)


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


def print_placement(experts_per_worker: list[list[list[int]]]) -> None:
    for w, layers in enumerate(experts_per_worker):
        print(f"  expert{w}: layer 0 holds {layers[0]}" + (f" ... ({len(layers)} layers)" if len(layers) > 1 else ""))
