"""``afdserve bench gpu``: decode on Qwen3-30B-A3B and Mixtral-8x7B layer shapes against transformers
and the memory-bandwidth bound (afdserve.bench.gpu)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("gpu", help="decode on real MoE layer shapes: tok/s vs transformers, the bandwidth bound, "
                                   "GPU busy fraction, launches and host syncs per step",
                       description="Random-weight 4-layer checkpoints with Qwen3-30B-A3B and Mixtral-8x7B layer "
                                   "shapes, built on the device; per context and batch: decode step time and tok/s "
                                   "of afdserve colocated (eager; on CUDA also triton attention, eager and in graphs) "
                                   "and of transformers, the step's memory-bandwidth bound (weights and KV read over "
                                   "a copy rate measured here), and from torch.profiler the GPU's busy fraction, "
                                   "kernels, launches and host syncs per step. Sized for 8 minutes of an H200 "
                                   "(--quick: 3); no engine run starts past --budget-s.")
    p.add_argument("--quick", action="store_true", help="Qwen3 shapes, context 512, batches 64 and 256, 12 steps")
    p.add_argument("--scale", choices=["real", "tiny"], default="real",
                   help="tiny: both shapes shrunk, float32, for a CPU check of the benchmark itself")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="default: bfloat16 (real), float32 (tiny)")
    p.add_argument("--shapes", type=lambda s: tuple(s.split(",")), default=None, help="qwen3,mixtral")
    p.add_argument("--contexts", type=_ints, default=None, help="prompt lengths, e.g. 512,2048")
    p.add_argument("--batches", type=_ints, default=None, help="e.g. 1,64,256")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per point")
    p.add_argument("--compile", action="store_true", help="also afdserve with compile=True")
    p.add_argument("--budget-s", type=float, default=None,
                   help="engine runs that would start later than this are skipped (default 420; --quick 150)")
    p.add_argument("--json", type=Path, default=None, help="write the result here (after each shape too)")
    return p


def table(result: dict) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, transformers {result['transformers']}, "
             f"copy {result['copy_gbps']:,.0f} GB/s"]
    head = (f"{'ctx':>5} {'batch':>5}  {'engine':18} {'tok/s':>9} {'step ms':>8} {'x hf':>5} {'bound ms':>8} "
            f"{'of bound':>8} {'busy':>5} {'kern/st':>7} {'launch/st':>9} {'sync/st':>7} {'same':>5}")
    for shape in result["shapes"].values():
        lines += [f"{shape['title']}, {shape['layers']} layers", head]
        for row in shape["points"]:
            for name, r in row.items():
                if not isinstance(r, dict) or name == "bound":
                    continue
                if "step_ms" not in r:
                    why = f"skipped: {r['skipped']}" if "skipped" in r else f"error: {r.get('error')}"
                    lines.append(f"{row['context']:>5} {row['batch']:>5}  {name:18} {why}")
                    continue
                tr = r["trace"] if isinstance(r.get("trace"), dict) else {}
                f = lambda v, fmt: format(v, fmt) if v is not None else format("-", fmt[:2])  # noqa: E731
                lines.append(f"{row['context']:>5} {row['batch']:>5}  {name:18} {r['tok_s']:>9,.0f} "
                             f"{r['step_ms']:>8.2f} "
                             f"{f(r.get('vs_transformers'), '>5.2f')} {row['bound']['step_ms']:>8.3f} "
                             f"{r['of_bound']:>8.1%} {f(r.get('busy_fraction'), '>5.0%')} "
                             f"{f(tr.get('kernels_per_step'), '>7.0f')} {f(tr.get('launches_per_step'), '>9.0f')} "
                             f"{f(tr.get('host_syncs_per_step'), '>7.1f')} "
                             f"{str(r['identical']) + '/' + str(row['batch']) if 'identical' in r else '-':>5}")
            b = row["bound"]
            lines.append(f"{'':>13}bound: {b['weight_bytes'] / 1e9:.3f} GB weights ({b['experts_touched']:.1f} experts "
                         f"a layer, {b['experts_basis']}) + {b['kv_bytes'] / 1e9:.3f} GB KV")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from afdserve.bench.gpu import SHAPES, make_plan, run

    if args.shapes and not set(args.shapes) <= set(SHAPES):
        raise SystemExit(f"afdserve bench gpu: --shapes takes {', '.join(SHAPES)}")
    if (args.steps is not None and args.steps < 2) or any(x < 1 for x in (args.contexts or ()) + (args.batches or ())):
        raise SystemExit("afdserve bench gpu: --steps must be >= 2, contexts and batches >= 1")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("afdserve bench gpu: this machine has no CUDA device (--device cpu --scale tiny runs "
                             "the benchmark's structure on the CPU)")
    plan = make_plan(args.quick, args.scale == "tiny", args.device, dtype=args.dtype, shapes=args.shapes,
                     contexts=args.contexts, batches=args.batches, steps=args.steps, compile=args.compile or None,
                     budget_s=args.budget_s)

    def save(result: dict) -> None:
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")

    result = run(plan, log=lambda s: print(s, flush=True), partial=save)
    print(table(result))
    save(result)
    if args.json:
        print(f"wrote {args.json}")
    return 0
