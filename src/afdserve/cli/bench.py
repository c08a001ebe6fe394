"""``afdserve bench <what>``: the benchmarks that ship with the package."""

from __future__ import annotations

import argparse
import importlib

BENCHES = {"m2n": "afdserve.cli.bench_m2n", "serve": "afdserve.cli.bench_serve", "kv": "afdserve.cli.bench_kv",
           "pd": "afdserve.cli.bench_pd", "cp": "afdserve.cli.bench_cp", "gpu": "afdserve.cli.bench_gpu"}


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="run a benchmark", description="Benchmarks: " + ", ".join(BENCHES))
    inner = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for module in BENCHES.values():
        mod = importlib.import_module(module)
        q = mod.add_parser(inner)
        q.set_defaults(bench_func=mod.main)
    return p


def main(args: argparse.Namespace) -> int:
    return int(args.bench_func(args) or 0)
