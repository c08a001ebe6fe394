"""What the kernels that borrow lent cores gain from them (the profile's ``runtime.lend_*``): the
fused MoE of a worker holding every expert, and the LM head, on every core over one thread."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from afdserve.profiling.parts import Checkpoint, expert_compute
from afdserve.runtime import ExpertInput, LayerKey

__all__ = ["measure_lend"]


def _speedup(call: Callable[[], object], threads: int, repeats: int, flush: Callable[[], None]) -> float:
    """Median wall time of ``call`` on one thread over its median on ``threads`` threads, the two
    alternating (a drift of the machine's speed hits both); at least 1: lent cores only add helper
    threads between a kernel's chunks, a kernel too small to chunk runs as it would alone."""
    one, many = [], []
    try:
        for _ in range(repeats):
            for n, out in ((1, one), (threads, many)):
                torch.set_num_threads(n)
                flush()
                t0 = time.perf_counter()
                call()
                out.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(1)
    return max(1.0, float(statistics.median(one) / statistics.median(many)))


@torch.inference_mode()
def measure_lend(
    model_path: Path,
    batches: Sequence[int],
    pairs_per_expert: Sequence[int],
    threads: int,
    repeats: int,
    flush: Callable[[], None],
    dtype: str = "float32",
    log: Callable[[str], None] = lambda s: None,
) -> tuple[list[list[float]], list[list[float]]]:
    """``([b, lm_head speed-up], [pairs, fused MoE speed-up])`` on ``threads`` threads: the LM head
    (greedy, as a plain decode step runs it) of ``b`` rows, and one layer of a worker holding every
    expert over ``pairs`` token-expert pairs.  Wall time: profile an idle machine."""
    ckpt = Checkpoint(model_path, dtype)
    cfg, dt = ckpt.cfg, ckpt.dtype
    gen = torch.Generator().manual_seed(2)
    model = ckpt.attention_model()
    head = []
    for b in batches:
        x = (torch.randn(b, cfg.hidden_size, generator=gen)).to(dt)
        model.greedy(x)
        s = _speedup(lambda: model.greedy(x), threads, repeats, flush)
        head.append([float(b), s])
        log(f"  LM head b={b:<4} x{s:.2f} on {threads} threads")
    del model
    E, K = cfg.num_experts, cfg.top_k
    compute = expert_compute(ckpt.experts(), E)
    moe = []
    for c in pairs_per_expert:
        tokens = max(1, c * E // K)
        ids = torch.tensor([[(t * K + j) % E for j in range(K)] for t in range(tokens)], dtype=torch.int32)
        y = (torch.randn(tokens, cfg.hidden_size, generator=gen) * 0.1).to(dt)
        w = torch.rand(tokens, K, generator=gen)

        def call() -> None:
            compute.run(0, [ExpertInput(LayerKey(0, 0, 0), 0, y, ids, w)])

        call()
        s = _speedup(call, threads, repeats, flush)
        moe.append([float(tokens * K), s])
        log(f"  experts pairs={tokens * K:<5} x{s:.2f} on {threads} threads")
    return head, moe
