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
    "scale": "afdserve.cli.scale",
    "autoscale-day": "afdserve.cli.autoscale_day",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default, unless its help tells it already or there is none
    (``None``, an on/off flag)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if "default" in help or not _shown(action):
            return help
        return super()._get_help_string(action)


def _shown(action: argparse.Action) -> bool:
    """Whether a default says anything: not None, '' or an on/off flag's False."""
    if action.default is None or action.default is argparse.SUPPRESS or action.default == "":
        return False
    return not isinstance(action.default, bool) or isinstance(action, argparse.BooleanOptionalAction)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Uses ``HelpFormatter`` in ``parser`` and every sub-command parser under it; options without a
    help text get one that shows their default."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                show_defaults(sub)
        elif not action.help and action.option_strings and _shown(action):
            action.help = "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="afdserve", description="Serve Mixture-of-Experts LLMs with "
                                     "disaggregated expert parallelism (attention and experts on separate workers).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS.values():
        mod = importlib.import_module(module)
        p = mod.add_parser(sub)
        p.set_defaults(func=mod.main)
    show_defaults(parser)
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
