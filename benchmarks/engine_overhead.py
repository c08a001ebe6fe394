"""Host time of a decode step outside the model: the engine core's and the front end's Python.

Every deployment runs these once per step (the colocated engine in its one thread, while the other
cores wait; an attention worker once per lane, at the lane's step boundary, where the expert workers
wait for its next layer): ``Engine.begin`` (scheduling, block reservations, inputs, metadata),
``Engine.finish`` with a greedy step's token ids (advancing the sequences, stop conditions,
outputs), the ``StepOutputs`` message an attention worker sends the front end (encoded and
decoded), and the front end's ``OutputProcessor.process`` (detokenization, stop strings, vLLM-shaped
outputs). The model is not run: ``S`` sequences with ``prompt`` tokens each decode ``steps`` tokens,
each step's token ids drawn at random from the demo model's vocabulary (its real tokenizer), and
the median microseconds per step of each part over the decode is reported, with glibc's allocator
set as in an engine process (``host_memory``).

    python benchmarks/engine_overhead.py [--seqs 64,256] [--prompt 32] [--steps 64] [--rounds 5]
                                         [--base TREE] [--json out/engine_overhead.json]

With ``--base TREE`` (another checkout's root, e.g. a ``git worktree`` of an older revision) each
round runs in two subprocesses, one importing afdserve from this tree and one from ``TREE`` (in
swapped order on odd rounds), and the table gives both sides' medians and the median of the
per-round ratios base / new of the total.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from afdserve.engine.engine import Engine
from afdserve.engine.host_memory import keep_freed_memory
from afdserve.engine.output_processor import OutputProcessor
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.scheduler import SchedulerConfig
from afdserve.engine.tokenizer import load_tokenizer
from afdserve.kvcache.block_manager import BlockManager
from afdserve.kvcache.prefix import PrefixCacheConfig
from afdserve.model.demo import demo_model_path
from afdserve.runtime.messages import AttentionStats, StepOutputs, decode, encode

PARTS = ("begin", "finish", "message", "front_end")


def one_round(seqs: int, prompt: int, steps: int, seed: int, tokenizer) -> dict[str, list[float]]:
    rng = random.Random(seed)
    vocab = tokenizer.tokenizer.get_vocab_size()
    block_size = 16
    per_seq = -(-(prompt + steps + 1) // block_size) + 1
    blocks = BlockManager(seqs * per_seq, block_size, PrefixCacheConfig(b"engine-overhead"))
    engine = Engine(None, blocks, SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=seqs * (prompt + 1)),
                    prompt + steps + 1, {2})
    front = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        ids = [rng.randrange(100, vocab) for _ in range(prompt)]
        front.add(f"r{i}", None, ids, params)
        engine.add_request(f"r{i}", ids, params)
    times: dict[str, list[float]] = {p: [] for p in PARTS}
    for step in range(steps + 1):
        t0 = time.perf_counter()
        s = engine.begin()
        t1 = time.perf_counter()
        chosen = torch.tensor([rng.randrange(100, vocab) for _ in s.sampled], dtype=torch.int64)
        t2 = time.perf_counter()
        outs = engine.finish(s, chosen)
        t3 = time.perf_counter()
        msg = decode(encode(StepOutputs("attention0", outs, AttentionStats(0, 0, 0.0, 0.0, 0, []))))
        t4 = time.perf_counter()
        front.process(msg.outputs)
        t5 = time.perf_counter()
        if step == 0:
            continue  # the prefill step
        for part, dt in zip(PARTS, (t1 - t0, t3 - t2, t4 - t3, t5 - t4)):
            times[part].append(dt)
    if engine.has_unfinished() or front.live:
        raise RuntimeError("the sequences did not finish with the last step")
    return times


def compare(args: argparse.Namespace) -> None:
    """Rounds of this tree and ``args.base`` in subprocesses, alternating; prints and writes both."""
    trees = {"new": Path(__file__).resolve().parents[1], "base": Path(args.base).resolve()}
    runs: dict[str, list[list[dict]]] = {"new": [], "base": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for side in (("new", "base") if r % 2 == 0 else ("base", "new")):
                out = os.path.join(tmp, f"{side}{r}.json")
                env = dict(os.environ, PYTHONPATH=str(trees[side] / "src"))
                subprocess.run([sys.executable, __file__, "--seqs", args.seqs, "--prompt", str(args.prompt),
                                "--steps", str(args.steps), "--rounds", "1", "--json", out], env=env, check=True,
                               stdout=subprocess.DEVNULL)
                with open(out) as f:
                    runs[side].append(json.load(f)["rows"])
    rows = []
    for i, seqs in enumerate(int(s) for s in args.seqs.split(",")):
        row: dict = {"seqs": seqs}
        for side in ("base", "new"):
            for key in [f"{p}_us" for p in PARTS] + ["total_us"]:
                row[f"{side}_{key}"] = statistics.median(run[i][key] for run in runs[side])
        row["ratios_base_over_new"] = [round(b[i]["total_us"] / n[i]["total_us"], 3)
                                       for b, n in zip(runs["base"], runs["new"])]
        row["ratio_base_over_new"] = statistics.median(row["ratios_base_over_new"])
        rows.append(row)
    print(f"{'seqs':>5} {'side':>5} " + " ".join(f"{p + ' us':>13}" for p in PARTS) + f" {'total us':>9}")
    for row in rows:
        for side in ("base", "new"):
            print(f"{row['seqs']:>5} {side:>5} " + " ".join(f"{row[f'{side}_{p}_us']:>13.0f}" for p in PARTS)
                  + f" {row[f'{side}_total_us']:>9.0f}")
        print(f"{row['seqs']:>5} base / new total: {row['ratio_base_over_new']:.2f} "
              f"(per round {', '.join(map(str, row['ratios_base_over_new']))})")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "engine_overhead", "prompt": args.prompt, "steps": args.steps,
                       "rounds": args.rounds, "base": str(trees["base"]), "rows": rows}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="64,256")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5, help="runs per batch size, alternating (medians over all)")
    ap.add_argument("--base", default=None, help="another tree's root: both measured, in alternating rounds")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.base:
        return compare(args)
    torch.set_num_threads(1)
    keep_freed_memory()  # as every engine process does
    tokenizer = load_tokenizer(demo_model_path())
    sizes = [int(s) for s in args.seqs.split(",")]
    acc: dict[int, dict[str, list[float]]] = {s: {p: [] for p in PARTS} for s in sizes}
    for r in range(args.rounds):
        for s in sizes:
            for part, ts in one_round(s, args.prompt, args.steps, r, tokenizer).items():
                acc[s][part].extend(ts)
    rows = []
    for s in sizes:
        med = {p: statistics.median(acc[s][p]) * 1e6 for p in PARTS}
        rows.append({"seqs": s, **{f"{p}_us": round(v, 1) for p, v in med.items()},
                     "total_us": round(sum(med.values()), 1), "per_seq_us": round(sum(med.values()) / s, 2)})
    print(f"{'seqs':>5} " + " ".join(f"{p + ' us':>13}" for p in PARTS) + f" {'total us':>9} {'per seq':>8}")
    for r in rows:
        print(f"{r['seqs']:>5} " + " ".join(f"{r[p + '_us']:>13.0f}" for p in PARTS)
              + f" {r['total_us']:>9.0f} {r['per_seq_us']:>8.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "engine_overhead", "prompt": args.prompt, "steps": args.steps,
                       "rounds": args.rounds, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
