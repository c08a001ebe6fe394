"""The ``afdserve`` command: one subcommand per task, each defined next to the code it drives."""

from __future__ import annotations

import argparse
import importlib
import sys

from afdserve.errors import AfdServeError

# subcommand -> module exposing add_parser(subparsers) and main(args)
COMMANDS = {
    "generate": "afdserve.cli.generate",
    "demo-model": "afdserve.model.demo",
    "serve": "afdserve.serving.cli",
    "bench": "afdserve.cli.bench",
    "plan": "afdserve.planner.cli",
    "profile": "afdserve.planner.profiler",
    "trace-plot": "afdserve.runtime.trace_plot",
    "expert-load": "afdserve.balance.cli",
    "rebalance": "afdserve.serving.rebalance_cli",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="afdserve", description="Serve Mixture-of-Experts LLMs with "
                                     "disaggregated expert parallelism (attention and experts on separate workers).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("afdserve"):
                continue  # a subsystem not built yet
            raise
        if not hasattr(mod, "add_parser"):
            continue
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
