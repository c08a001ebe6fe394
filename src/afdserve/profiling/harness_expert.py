"""The expert worker's work per layer, for every number of experts a worker can hold (the profile's
``k3``, ``k4``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from afdserve.profiling.parts import Checkpoint, expert_compute
from afdserve.profiling.timers import median_time
from afdserve.runtime import ExpertInput, LayerKey

__all__ = ["measure_expert"]


@torch.inference_mode()
def measure_expert(
    model_path: Path,
    experts_per_node: Sequence[int],
    pairs_per_expert: Sequence[int],
    repeats: int,
    flush: Callable[[], None],
    dtype: str = "float32",
    log: Callable[[str], None] = lambda s: None,
) -> dict[int, list[list[float]]]:
    """``{experts held: [[pairs, seconds], ...]}``: ``ExpertCompute.run`` of one layer over ``pairs``
    token-expert pairs, every held expert receiving the same number (tokens pick K distinct
    experts, all held by this worker)."""
    ckpt = Checkpoint(model_path, dtype)
    cfg, dt = ckpt.cfg, ckpt.dtype
    k = cfg.top_k
    gen = torch.Generator().manual_seed(1)
    out: dict[int, list[list[float]]] = {}
    for epn in experts_per_node:
        compute = expert_compute(ckpt.experts(list(range(epn))), epn)
        rows: list[list[float]] = []
        for c in pairs_per_expert:
            pairs = c * epn
            kk = min(k, epn)
            tokens = -(-pairs // kk)
            # token t takes experts (t*kk + j) mod epn: every held expert gets pairs/epn pairs
            ids = torch.tensor([[(t * kk + j) % epn for j in range(kk)] for t in range(tokens)], dtype=torch.int32)
            if kk < k:  # the token's other experts live on other workers (id E = "elsewhere")
                ids = torch.cat([ids, torch.full((tokens, k - kk), cfg.num_experts, dtype=torch.int32)], 1)
            y = (torch.randn(tokens, cfg.hidden_size, generator=gen) * 0.1).to(dt)
            w = torch.rand(tokens, k, generator=gen)
            layer = [0]

            def call() -> None:
                lyr = layer[0] % cfg.num_layers
                layer[0] += 1
                compute.run(lyr, [ExpertInput(LayerKey(0, 0, lyr), 0, y, ids, w)])

            call()
            t = median_time(call, repeats, flush)
            real_pairs = tokens * kk
            rows.append([float(real_pairs), t])
            log(f"  experts={epn:<3} pairs={real_pairs:<5} {t * 1e6:9.1f} us")
        out[epn] = rows
    return out
