"""Two workers computing at once: how much an attention worker's and an expert worker's work slow
each other down on two cores (shared last-level cache and memory bandwidth; the profile's
``runtime.corun_*``).  The partner process is ``python -m afdserve.profiling.corun_partner``."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from afdserve.profiling.parts import Checkpoint, decode_layout, expert_compute, kv_cache, step_context
from afdserve.runtime import ExpertInput, LayerKey
from afdserve.profiling.probes import cpu_cores
from afdserve.profiling.timers import median_time

__all__ = ["measure_corun", "attention_work", "expert_work"]


def attention_work(ckpt: Checkpoint) -> tuple[Callable[[int], None], Callable[[], None]]:
    """An attention worker's work on a decode micro-batch of 16 (64 tokens of context): ``(one
    layer, the LM head)``."""
    cfg, dt = ckpt.cfg, ckpt.dtype
    model = ckpt.attention_model()
    layout, blocks = decode_layout(16, 64, 16)
    kv = kv_cache(cfg, blocks, 16, dt)
    x = torch.randn(16, cfg.hidden_size).to(dt)
    ctx = step_context(model, layout)

    def layer(lyr: int) -> None:
        h, y, _ids, _w = model.pre_moe(lyr, x, ctx, kv)
        model.post_moe(lyr, h, y, torch.zeros_like(y))

    return layer, lambda: model.logits(x)


def expert_work(ckpt: Checkpoint, pairs_per_expert: int) -> Callable[[int], None]:
    """An expert worker holding every expert: one layer over ``pairs_per_expert`` pairs an expert."""
    cfg, dt = ckpt.cfg, ckpt.dtype
    compute = expert_compute(ckpt.experts(), cfg.num_experts)
    k = cfg.top_k
    tokens = pairs_per_expert * cfg.num_experts // k
    ids = torch.tensor([[(t * k + j) % cfg.num_experts for j in range(k)] for t in range(tokens)], dtype=torch.int32)
    y, w = torch.randn(tokens, cfg.hidden_size).to(dt), torch.rand(tokens, k)
    return lambda lyr: compute.run(lyr, [ExpertInput(LayerKey(0, 0, lyr), 0, y, ids, w)])


def measure_corun(
    model_path: Path,
    repeats: int,
    flush: Callable[[], None],
    dtype: str = "float32",
    log: Callable[[str], None] = lambda s: None,
) -> tuple[float, float]:
    """``(attention factor, expert factor)``: how much longer (CPU time) an attention worker's work
    (a micro-batch of 16 through a layer, and the LM head) and an expert worker's round take while the
    other role computes on another core, than alone.  (1.0, 1.0) with fewer than two cores."""
    if cpu_cores() < 2 or not hasattr(os, "sched_setaffinity"):
        return 1.0, 1.0
    ckpt = Checkpoint(model_path, dtype)
    cfg = ckpt.cfg
    attention_layer, lm_head = attention_work(ckpt)
    expert_layer = expert_work(ckpt, 4)
    n = [0]

    def attention() -> None:
        attention_layer(n[0] % cfg.num_layers)
        n[0] += 1

    def expert() -> None:
        expert_layer(n[0] % cfg.num_layers)
        n[0] += 1

    mask = os.sched_getaffinity(0)
    a, b = sorted(mask)[:2]
    os.sched_setaffinity(0, {a})
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ratios: dict[str, list[float]] = {"attention": [], "expert": []}
    try:
        for partner, mine in (("expert", (attention, lm_head)), ("attention", (expert,))):
            alone = [median_time(fn, repeats, flush) for fn in mine]
            proc = subprocess.Popen([sys.executable, "-m", "afdserve.profiling.corun_partner", partner,
                                     str(model_path), dtype, "300"], env=env, stdout=subprocess.PIPE, text=True)
            try:
                os.sched_setaffinity(proc.pid, {b})
                assert proc.stdout is not None
                ready, _, _ = select.select([proc.stdout], [], [], 120)
                if not ready or proc.stdout.readline().strip() != "ready":  # it loaded its weights
                    raise RuntimeError(f"co-run partner did not start (exit code {proc.poll()})")
                time.sleep(0.2)
                together = [median_time(fn, repeats, flush) for fn in mine]
            finally:
                proc.kill()
                proc.wait(10)
            alone2 = [median_time(fn, repeats, flush) for fn in mine]
            # alone before the partner started and after it was killed: compare with the mean of
            # both, so a drift of the machine's speed during the measurement cancels
            role = "attention" if partner == "expert" else "expert"
            for t, a1, a2 in zip(together, alone, alone2):
                ratios[role].append(t / ((a1 + a2) / 2))
    finally:
        os.sched_setaffinity(0, mask)
    fa = max(1.0, float(np.mean(ratios["attention"])))
    fe = max(1.0, float(np.mean(ratios["expert"])))
    log(f"  attention worker x{fa:.3f} while an expert worker computes, expert worker x{fe:.3f} "
        f"while an attention worker computes")
    return fa, fe
