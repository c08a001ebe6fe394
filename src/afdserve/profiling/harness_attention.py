"""The attention worker's work per micro-batch and layer (the profile's ``k1_tok``, ``k1_ctx``, ``k2``
and the dispatch's cost per expert worker)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from afdserve.backends.step import StepLayout
from afdserve.kvcache import KVCache
from afdserve.profiling.loopback import LoopbackLinks
from afdserve.profiling.parts import Checkpoint, attention_runner, decode_layout, kv_cache, step_context
from afdserve.profiling.timers import median_time
from afdserve.runtime import ExpertMap, LayerKey, Tracer

__all__ = ["measure_attention", "measure_colocated_attention"]


def _decode_point(ckpt: Checkpoint, b: int, s: int, block_size: int,
                  gen: torch.Generator) -> tuple[int, KVCache, StepLayout, torch.Tensor]:
    """``(s, kv, layout, x)`` of one timed point: ``s`` clipped to the model's context, a paged cache
    of ``b`` sequences of ``s`` tokens filled with noise, their decode layout and the layer input."""
    cfg, dt = ckpt.cfg, ckpt.dtype
    s = max(2, min(int(s), cfg.max_position_embeddings - 1))
    layout, blocks = decode_layout(b, s, block_size)
    kv = kv_cache(cfg, blocks, block_size, dt)
    for t in kv.tensors():
        t.normal_(0, 1, generator=gen)
    return s, kv, layout, (torch.randn(b, cfg.hidden_size, generator=gen) * 0.1).to(dt)


@torch.inference_mode()
def measure_attention(
    model_path: Path,
    points: Sequence[tuple[int, int, int]],
    repeats: int,
    flush: Callable[[], None],
    dtype: str = "float32",
    block_size: int = 16,
    log: Callable[[str], None] = lambda s: None,
) -> list[list[float]]:
    """``[b, s, n_e, seconds]`` for each ``(b, s, n_e)`` of ``points``: one decode micro-batch of
    ``b`` sequences with ``s`` tokens of context through one layer of the attention worker, in the
    order ``PipelinedRunner`` runs it -- ``combine`` of the previous layer's expert results
    (merge + ``post_moe``), ``pre_moe`` (attention over the paged ``KVCache`` + router) and
    ``dispatch`` to ``n_e`` expert workers (per-worker token selection; the sends go to a
    loop-back link).  ``flush`` (the cache eviction) runs before each call, where the worker would
    wait for the expert workers.  Median over ``repeats`` calls cycling through the layers."""
    ckpt = Checkpoint(model_path, dtype)
    cfg, dt = ckpt.cfg, ckpt.dtype
    model = ckpt.attention_model()
    gen = torch.Generator().manual_seed(0)
    out = []
    for b, s, n_e in points:
        n_e = max(1, min(int(n_e), cfg.num_experts))
        s, kv, layout, x = _decode_point(ckpt, b, s, block_size, gen)
        emap = ExpertMap.contiguous(cfg.num_layers, cfg.num_experts, n_e)
        runner = attention_runner(model, kv, LoopbackLinks(cfg.hidden_size, dt), emap, Tracer("profile"))
        ctx = step_context(model, layout)
        state: dict[str, Any] = {"n": 0, "flight": None}

        def call() -> None:
            lyr = state["n"] % cfg.num_layers
            state["n"] += 1
            d = state["flight"]
            if d is not None:
                runner.wait(d)
                runner.combine(d)
            h, y, ids, w = model.pre_moe(lyr, x, ctx, kv)
            state["flight"] = runner.dispatch(LayerKey(0, 0, lyr), h, y, ids, w)

        call()  # warm-up (allocator, kernels)
        t = median_time(call, repeats, flush)
        out.append([float(b), float(s), float(n_e), t])
        log(f"  attention b={b:<4} s={s:<5} n_e={n_e:<2} {t * 1e6:9.1f} us")
    return out


@torch.inference_mode()
def measure_colocated_attention(
    model_path: Path,
    points: Sequence[tuple[int, int]],
    repeats: int,
    flush: Callable[[], None],
    dtype: str = "float32",
    block_size: int = 16,
    log: Callable[[str], None] = lambda s: None,
) -> list[list[float]]:
    """``[b, s, seconds]`` for each ``(b, s)`` of ``points``: one decode layer of the colocated engine
    (``ModelRunner.forward``) outside its experts -- ``pre_moe`` and ``post_moe`` over the experts'
    output, no dispatch.  Median over ``repeats`` calls cycling through the layers."""
    ckpt = Checkpoint(model_path, dtype)
    cfg = ckpt.cfg
    model = ckpt.attention_model()
    gen = torch.Generator().manual_seed(0)
    out = []
    for b, s in points:
        s, kv, layout, x = _decode_point(ckpt, b, s, block_size, gen)
        routed = torch.zeros_like(x)
        ctx = step_context(model, layout)
        n = [0]

        def call() -> None:
            lyr = n[0] % cfg.num_layers
            n[0] += 1
            h, y, _, _ = model.pre_moe(lyr, x, ctx, kv)
            model.post_moe(lyr, h, y, routed)

        call()
        t = median_time(call, repeats, flush)
        out.append([float(b), float(s), t])
        log(f"  colocated attention b={b:<4} s={s:<5} {t * 1e6:9.1f} us")
    return out
