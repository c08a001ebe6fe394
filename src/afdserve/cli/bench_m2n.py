"""``afdserve bench m2n``: the M2N communication micro-benchmark."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import fields

from afdserve.bench import m2n
from afdserve.bench.m2n_report import fmt_size

DEFAULT_SIZES = ",".join(fmt_size(s) for s in m2n.DEFAULT_SIZES)
_UNITS = {"": 1, "b": 1, "kb": 1000, "kib": 1024, "k": 1024, "mb": 1000**2, "mib": 1024**2, "m": 1024**2,
          "gb": 1000**3, "gib": 1024**3, "g": 1024**3}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 2KiB, 256KiB, 8MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _csv(conv):
    def parse(text: str) -> list:
        return [conv(x) for x in text.split(",") if x.strip()]
    return parse


def _transports(text: str) -> list[str]:
    from afdserve.bench.m2n_layer import LAYER_TRANSPORTS

    out = _csv(str.strip)(text)
    known = list(m2n.ALL_TRANSPORTS) + [t for t in LAYER_TRANSPORTS if t not in m2n.ALL_TRANSPORTS]
    bad = [t for t in out if t not in known]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown transport(s) {bad}; use {','.join(known)}")
    return out


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``m2n`` on the ``afdserve bench`` sub-command's subparsers."""
    p = subparsers.add_parser("m2n", help="M2N communication micro-benchmark (latency, throughput)",
                              description=m2n.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transports", type=_transports, default=None,
                   help="comma list of shm,tcp,torch,torch_raw (torch_raw: plain gloo send/recv, no metadata; "
                        "default all; --layer: shm,tcp,torch, and cuda_ipc (which needs it) with --device cuda)")
    p.add_argument("--sizes", type=_csv(parse_size), default=_csv(parse_size)(DEFAULT_SIZES),
                   help=f"bytes per sender->receiver message (default {DEFAULT_SIZES})")
    p.add_argument("--senders", type=int, default=1, help="M for the size sweep")
    p.add_argument("--receivers", type=int, default=1, help="N for the size sweep")
    p.add_argument("--scale", type=_csv(int), default=None,
                   help="M=N values of the scaling sweep (empty string to skip; default 1,2,4; --layer: 1,2)")
    p.add_argument("--scale-size", type=parse_size, default=256 << 10, help="message size of the scaling sweep")
    p.add_argument("--iters", type=int, default=None, help="timed latency iterations per point (default 500; "
                   "--layer: 200)")
    p.add_argument("--slots", type=int, default=4, help="registered slots per pair")
    p.add_argument("--spin-us", type=float, default=100.0, help="busy-poll time before blocking (CommConfig.spin_s)")
    p.add_argument("--pin", action="store_true",
                   help="pin worker processes to CPUs round-robin (all transports alike)")
    p.add_argument("--json", dest="json_path", default=None, help="write results here")
    p.add_argument("--plot", dest="plot_path", default=None, help="save a PNG of the results here")
    layer = p.add_argument_group("--layer: one MoE layer's dispatch + combine (afdserve.bench.m2n_layer)")
    layer.add_argument("--layer", action="store_true",
                       help="time a layer's dispatch + combine as the runtime does it, per transport, at M = N "
                            "of --scale")
    layer.add_argument("--tokens", type=int, default=256, help="tokens per attention process and layer")
    layer.add_argument("--hidden", type=int, default=2048)
    layer.add_argument("--experts", type=int, default=128)
    layer.add_argument("--top-k", type=int, default=8)
    layer.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    layer.add_argument("--device", default="cpu", help="where the tensors live: cpu, cuda or cuda:N (the torch "
                       "transport then runs NCCL)")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    if args.layer:
        return _layer(args)
    args.transports = args.transports if args.transports is not None else list(m2n.ALL_TRANSPORTS)
    args.scale = args.scale if args.scale is not None else [1, 2, 4]
    args.iters = args.iters if args.iters is not None else 500
    if args.senders < 1 or args.receivers < 1 or args.iters < 1:
        print("error: --senders, --receivers and --iters must be >= 1", file=sys.stderr)
        return 2
    bad = [t for t in args.transports if t not in m2n.ALL_TRANSPORTS]
    if bad:
        print(f"error: {','.join(bad)} runs only with --layer (use {','.join(m2n.ALL_TRANSPORTS)})", file=sys.stderr)
        return 2
    m2n.run_m2n(m2n.M2NOptions(**{f.name: getattr(args, f.name) for f in fields(m2n.M2NOptions)}))
    return 0


def _layer(args: argparse.Namespace) -> int:
    from afdserve.bench.m2n_layer import LAYER_TRANSPORTS, LayerOptions, run_layer

    cuda = args.device.startswith("cuda")
    transports = args.transports if args.transports is not None else \
        list(LayerOptions.transports) + (["cuda_ipc"] if cuda else [])
    scale = args.scale if args.scale is not None else [1, 2]
    if "cuda_ipc" in transports and not cuda:
        print("error: --transports cuda_ipc needs --device cuda[:N] (the slots live on the GPU)", file=sys.stderr)
        return 2
    bad = [t for t in transports if t not in LAYER_TRANSPORTS]
    if bad or not scale or min(scale) < 1 or min(args.tokens, args.hidden, args.experts, args.top_k) < 1 \
            or args.top_k > args.experts or (args.iters is not None and args.iters < 1):
        print(f"error: --layer takes transports of {','.join(LAYER_TRANSPORTS)}, M=N values >= 1, and "
              "--tokens, --hidden, --experts, --top-k (<= --experts) and --iters >= 1", file=sys.stderr)
        return 2
    run_layer(LayerOptions(transports, scale, args.tokens, args.hidden, args.experts, args.top_k, args.dtype,
                           args.device, args.iters or 200, args.json_path))
    return 0
