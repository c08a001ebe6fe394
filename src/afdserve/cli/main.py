"""The ``afdserve`` command: one subcommand per task, each a module of ``afdserve.cli`` (the only
package that parses arguments)."""

from __future__ import annotations

import argparse
import importlib
import sys

from afdserve.errors import AfdServeError

# subcommand -> module exposing add_parser(subparsers) and main(args)
COMMANDS = {
    "generate": "afdserve.cli.generate",
    "demo-model": "afdserve.cli.demo_model",
    "serve": "afdserve.cli.serve",
    "bench": "afdserve.cli.bench",
    "plan": "afdserve.cli.plan",
    "profile": "afdserve.cli.profile",
    "trace-plot": "afdserve.cli.trace_plot",
    "expert-load": "afdserve.cli.expert_load",
    "rebalance": "afdserve.cli.rebalance",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="afdserve", description="Serve Mixture-of-Experts LLMs with "
                                     "disaggregated expert parallelism (attention and experts on separate workers).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS.values():
        mod = importlib.import_module(module)
        p = mod.add_parser(sub)
        p.set_defaults(func=mod.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except AfdServeError as e:
        print(f"afdserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
