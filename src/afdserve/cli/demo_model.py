"""``afdserve demo-model PATH``: write the built-in demo checkpoint."""

from __future__ import annotations

import argparse

from afdserve.model import demo


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``afdserve demo-model PATH`` on an ``argparse`` subparsers object."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "demo-model",
        help="write the built-in random-weight Mixtral-style demo checkpoint (HF format)",
        description="Write the built-in demo model (random bf16 weights from a fixed seed, real "
        "Mixtral v1 tokenizer) as a Hugging Face checkpoint into PATH.",
    )
    p.add_argument("path", metavar="PATH", help="output directory (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0 = the embedded demo model)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    """Entry point of ``afdserve demo-model``."""
    out = demo.build_demo_model(args.path, seed=args.seed)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote demo model v{demo.DEMO_MODEL_VERSION} (seed {args.seed}, {size / 2**20:.1f} MiB) to {out}")
    return 0
