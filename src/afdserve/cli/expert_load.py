"""``afdserve expert-load SNAPSHOT --out PNG``: draw a load snapshot's per-layer heatmap.

The main CLI registers it with ``add_parser(subparsers)``; the parser's default ``func`` is
:func:`main`. ``python -m afdserve.cli.expert_load SNAPSHOT --out PNG`` runs it on its own.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from afdserve.balance.heatmap import draw_heatmap
from afdserve.balance.load import LoadSnapshot
from afdserve.errors import AfdServeError

COMMAND = "expert-load"


def _layers(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def configure(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("snapshot", metavar="SNAPSHOT", help="expert-load snapshot JSON (LoadSnapshot.save / GET the snapshot endpoint)")
    parser.add_argument("--out", required=True, metavar="PNG", help="output image")
    parser.add_argument("--layers", type=_layers, default=None, help="layers to draw, e.g. 0-3,10 (default: all)")
    parser.add_argument("--relative", action="store_true", help="colour load / layer mean instead of tokens per step")
    parser.add_argument("--coactivation", type=int, default=None, metavar="LAYER", help="add LAYER's co-activation matrix")
    parser.add_argument("--title", default=None)
    parser.set_defaults(func=main)
    return parser


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds the ``expert-load`` sub-command to an ``argparse`` sub-parsers object."""
    parser = subparsers.add_parser(COMMAND, help="draw the per-layer expert load heatmap of a snapshot")
    return configure(parser)


def main(args: argparse.Namespace) -> int:
    try:
        snap = LoadSnapshot.load(args.snapshot)
        path = draw_heatmap(
            snap, args.out, layers=args.layers, relative=args.relative, coactivation_layer=args.coactivation, title=args.title
        )
    except (OSError, ValueError, AfdServeError) as e:
        print(f"afdserve {COMMAND}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {path} ({snap.num_layers} layers x {snap.num_experts} experts, {snap.steps} steps)")
    return 0


def run(argv: Sequence[str] | None = None) -> int:
    parser = configure(argparse.ArgumentParser(prog=f"afdserve {COMMAND}", description=__doc__.splitlines()[0]))
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(run())
