"""The MoE work of one decode step as each deployment's cores see it: the demo model's expert layers
(bf16, the engine's fused MoE kernel) for a step of B decoding tokens, run

  * as the colocated engine runs them: one call of B tokens per layer, on ``--cores`` threads;
  * as the expert worker of 1 + 1 with m lanes runs them: m calls of B/m tokens per layer (one lane
    after the other, as the ping-pong pipeline brings them), on one thread (its own core);
  * as one call of B tokens per layer on one thread (the lanes' cost of re-reading the weights).

Nothing else runs meanwhile (no attention worker beside it, no messages, no Python pipeline), so the
m-lane figure is a floor for the expert worker's busy time per decode step: compare it with the
colocated engine's whole decode step (``benchmarks/disagg_phases.py``). The three alternate step by
step; the layers of a step are cycled in order, so each layer's weights come from memory (they do not
all fit in the caches), and the second lane's call finds them where the first left them. Medians.

    python benchmarks/moe_lanes.py [--batches 64,256] [--m 2] [--steps 40] [--json out/moe_lanes.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--m", type=int, default=2, help="lanes of the disaggregated deployment")
    ap.add_argument("--cores", type=int, default=2, help="threads of the colocated engine")
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed per way (after 5 warm-up steps)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from afdserve.engine.host_memory import keep_freed_memory
    from afdserve.model.demo import demo_model_path
    from afdserve.model.model import ExpertModel

    keep_freed_memory()  # as the engine's processes run
    model = ExpertModel.load(str(demo_model_path()), dtype="bfloat16")
    layers = [p for p in model.layers if p.expert_ids]
    e, k, h = model.cfg.num_experts, model.cfg.top_k, model.cfg.hidden_size
    g = torch.Generator().manual_seed(0)
    ways = {"colocated": (1, args.cores), "lanes": (args.m, 1), "one call, 1 thread": (1, 1)}
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        if batch % args.m:
            ap.error(f"batch {batch} does not split into {args.m} lanes")

        def inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return (torch.randn(tokens, h, generator=g).to(torch.bfloat16),
                    torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(tokens)]),
                    torch.softmax(torch.randn(tokens, k, generator=g), -1))

        calls = {name: [inputs(batch // m) for _ in range(m)] for name, (m, _) in ways.items()}
        times: dict[str, list[float]] = {name: [] for name in ways}
        with torch.inference_mode():
            for step in range(5 + args.steps):
                for name, (_, threads) in ways.items():
                    torch.set_num_threads(threads)
                    t0 = time.perf_counter()
                    for part in layers:
                        for y, ids, w in calls[name]:
                            part(y, ids, w)
                    if step >= 5:
                        times[name].append((time.perf_counter() - t0) * 1e3)
        med = {name: statistics.median(v) for name, v in times.items()}
        rows.append({"batch": batch, "m": args.m, "colocated_threads": args.cores,
                     **{f"{name.replace(', ', '_').replace(' ', '_')}_ms": round(v, 3) for name, v in med.items()}})
        print(f"batch {batch:>4}: MoE per decode step: colocated (1 call per layer, {args.cores} threads) "
              f"{med['colocated']:6.2f} ms; expert worker ({args.m} lanes, 1 thread) {med['lanes']:6.2f} ms "
              f"({med['lanes'] / med['colocated']:.2f}x); one call, 1 thread {med['one call, 1 thread']:6.2f} ms")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "moe_lanes", "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
