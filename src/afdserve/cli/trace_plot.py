"""``afdserve trace-plot TRACE --out PNG``: draw a deployment trace as a ping-pong timeline."""

from __future__ import annotations

import argparse

from afdserve.runtime.trace_plot import load, plot, usage


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("trace-plot", help="draw a deployment trace as a ping-pong timeline",
                       description="Draw the timeline of a --trace JSON and print busy/idle fractions per worker.")
    p.add_argument("trace", help="Chrome/Perfetto JSON written with --trace")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--start-ms", type=float, default=None, help="start of the drawn window (from the first span)")
    p.add_argument("--span-ms", type=float, default=None, help="length of the drawn window")
    return p


def main(args: argparse.Namespace) -> int:
    spans = load(args.trace)
    plot(spans, args.out, args.start_ms, args.span_ms)
    print(f"{'worker':<12} {'busy':>6} {'send':>6} {'wait/idle':>9}   (steady state, {usage(spans)[0].window_ms:.0f} ms)")
    for u in usage(spans):
        print(f"{u.worker:<12} {u.busy:>6.1%} {u.comm:>6.1%} {u.wait:>9.1%}")
    print(f"wrote {args.out}")
    return 0
