"""``afdserve profile --out PROFILE``: measure this machine's k1..k4, Util and runtime costs for the
planner (:func:`afdserve.profiling.run_profile`) and save the profile.

The main CLI registers this module with ``add_parser(subparsers)`` and dispatches to ``main(args)``;
``main`` also takes an argv list.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from afdserve.planner import profile_summary, save_profile
from afdserve.profiling import DEFAULT_GRID, QUICK_GRID, ProfileGrid, run_profile

__all__ = ["add_parser", "grid_from_args", "main"]


def _ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("expected positive integers")
    return vals


def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--out", type=Path, required=True, help="where to write the profile (JSON)")
    p.add_argument("--model", default=None, help="model folder (default: the built-in demo model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weights and activations, as the deployment will run (default float32)")
    p.add_argument("--quick", action="store_true", help="a small grid (about a third of the time)")
    p.add_argument("--batches", type=_ints, help="attention micro-batch sizes b_a")
    p.add_argument("--seq-lens", type=_ints, help="context lengths s")
    p.add_argument("--pairs-per-expert", type=_ints, help="token-expert pairs per held expert")
    p.add_argument("--experts-per-node", type=_ints, help="expert counts per worker (default: divisors of E)")
    p.add_argument("--msg-tokens", type=_ints, help="tokens per M2N message")
    p.add_argument("--step-batches", type=_ints, help="sequences per engine step")
    p.add_argument("--repeats", type=int, help="timed calls per point and pass (median)")
    p.add_argument("--passes", type=int, help="passes over the grid (a point keeps its least median)")
    p.add_argument("--warm", action="store_true", help="do not evict the caches before timed calls")
    p.add_argument("--no-corun", action="store_true",
                   help="skip measuring how two workers computing at once slow each other (factors 1)")
    p.add_argument("--gpu", default="cpu", help="device label of the entries (catalog name; default cpu)")
    p.add_argument("--quiet", action="store_true", help="print only the summary")
    return p


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Register ``profile`` on the main CLI's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "profile",
        help="measure k1..k4, Util and runtime costs of this machine for the planner",
        description="Run the real attention/expert code and M2N transport over a grid, fit the planner's "
                    "constants and save them (afdserve plan --profile, planner.predict_iteration_time).",
    )
    _configure(p)
    p.set_defaults(func=main)
    return p


def grid_from_args(args: argparse.Namespace) -> ProfileGrid:
    g = QUICK_GRID if args.quick else DEFAULT_GRID
    over: dict[str, Any] = {}
    for name in ("batches", "seq_lens", "pairs_per_expert", "experts_per_node", "msg_tokens", "step_batches"):
        if getattr(args, name, None):
            over[name] = tuple(getattr(args, name))
    for name in ("repeats", "passes"):
        v = getattr(args, name, None)
        if v is not None:
            if v < 1:
                raise SystemExit(f"afdserve profile: --{name} must be >= 1")
            over[name] = v
    if getattr(args, "no_corun", False):
        over["corun"] = False
    return replace(g, **over)


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    if not isinstance(args, argparse.Namespace):
        argv = list(sys.argv[1:] if args is None else args)
        if argv and argv[0] == "profile":
            argv = argv[1:]
        args = _configure(argparse.ArgumentParser(prog="afdserve profile")).parse_args(argv)
    log = (lambda s: None) if args.quiet else (lambda s: print(s, flush=True))
    t0 = time.perf_counter()
    prof = run_profile(args.model, grid_from_args(args), dtype=args.dtype, evict=not args.warm, gpu=args.gpu,
                       log=log)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(prof, args.out)
    print(profile_summary(prof))
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")
    return 0
