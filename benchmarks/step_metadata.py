"""Host time of a decode step's attention metadata on its way to a device (the CUDA path).

A step's ``AttnMetadata`` is built on the host from the block tables and moved with its decode keys
prepared (``to``: padded slots and masks per key window, then the copies). The engine gathers the
tables from the block manager's persistent rows (``BlockManager.batch_table``, then ``from_table``);
the "lists" column builds them from each sequence's list instead (``block_table``, then
``from_blocks``: what the engine did before), the two alternating rep by rep. On the CPU nothing
moves; on CUDA this is host work on every step of every lane. Measured here with the ``meta`` device
(placement only, no data), so the figures are the host's part alone: median microseconds over
``--reps`` steps of ``S`` decoding sequences with ``context`` tokens each, blocks scattered as after
churn (the sequences grew a block at a time in shuffled turns), with glibc's allocator set as in an
engine process (``host_memory``).

    python benchmarks/step_metadata.py [--seqs 64,256] [--contexts 96,2048] [--json out/step_metadata.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from afdserve.engine.host_memory import keep_freed_memory
from afdserve.kvcache.block_manager import BlockManager
from afdserve.model.attention import AttnMetadata


def measure(seqs: int, context: int, windows: tuple[int, ...], reps: int, block_size: int = 16) -> dict:
    gen = torch.Generator().manual_seed(seqs * 7 + context)
    blocks = -(-context // block_size)
    bm = BlockManager(seqs * blocks, block_size)
    ids = list(range(seqs))
    for j in range(blocks):  # the sequences grow a block at a time, in a new order each time: scattered
        for s in torch.randperm(seqs, generator=gen).tolist():
            bm.reserve(s, min(context, (j + 1) * block_size))
    lens = [context - int(x) for x in torch.randint(0, block_size, (seqs,), generator=gen)]
    lists, rows, move = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        AttnMetadata.from_blocks([1] * seqs, lens, [bm.block_table(s) for s in ids], block_size)
        t1 = time.perf_counter()
        meta = AttnMetadata.from_table([1] * seqs, lens, bm.batch_table(ids), block_size)
        t2 = time.perf_counter()
        meta.to(torch.device("meta"), windows)
        t3 = time.perf_counter()
        lists.append(t1 - t0)
        rows.append(t2 - t1)
        move.append(t3 - t2)
    return {"seqs": seqs, "context": context, "windows": list(windows), "rows_us": statistics.median(rows) * 1e6,
            "lists_us": statistics.median(lists) * 1e6, "to_device_us": statistics.median(move) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="64,256")
    ap.add_argument("--contexts", default="96,2048")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as every engine process does
    rows = [measure(s, c, w, args.reps) for s in map(int, args.seqs.split(",")) for c in map(int, args.contexts.split(","))
            for w in ((0,), (0, 128))]
    print(f"{'seqs':>5} {'context':>8} {'windows':>9} {'rows us':>8} {'lists us':>9} {'to(device) us':>14}")
    for r in rows:
        print(f"{r['seqs']:>5} {r['context']:>8} {str(tuple(r['windows'])):>9} {r['rows_us']:>8.0f} "
              f"{r['lists_us']:>9.0f} {r['to_device_us']:>14.0f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "step_metadata", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
