"""KV capacity: bytes per token of a model's paged KV cache, the tokens one attention worker holds,
and how many context-parallel ranks a prompt needs (``afdserve plan kv``).

The same arithmetic as the engine's allocation (``engine.builder.kv_blocks``, ``KVCache``): every
layer keeps K and V of ``num_kv_heads x head_dim`` per token, or MLA's latent (``kv_latent_dim``);
a worker's cache is ``kv_cache_gb`` split into blocks of ``block_size`` tokens (or
``num_kv_blocks``); a sequence holds one block per ``block_size`` tokens, except where every layer
has a sliding window: then the blocks out of the window go back and a sequence holds at most the
window plus one step's tokens. ``fp8_e4m3`` is the engine's ``kv_cache_dtype="fp8_e4m3"``: one
byte per element plus a float32 scale per block and KV head (per block for MLA's latent).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from afdserve.errors import ConfigError
from afdserve.kvcache.cache import KVCache
from afdserve.model.config import ModelConfig
from afdserve.planner.spec import ModelSpec

# the dtypes the report knows (what the engine's KV cache stores)
KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
             "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class KVShape:
    """What a model's KV cache stores per token: the engine's checkpoint config or a planner preset."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    latent_dim: int = 0  # MLA: values cached per token and layer (0: K and V per head)
    window: int = 0  # every layer's sliding window (0: some layer attends to everything)

    @staticmethod
    def of(model: ModelConfig | ModelSpec, name: str = "") -> "KVShape":
        if isinstance(model, ModelSpec):  # presets carry no windows
            latent = model.mla.kv_lora_rank + model.mla.qk_rope_head_dim if model.mla is not None else 0
            return KVShape(name or model.name, model.num_layers, model.num_kv_heads, model.head_dim, latent)
        return KVShape(name, model.num_layers, model.num_kv_heads, model.head_dim, model.kv_latent_dim,
                       model.kv_window)


@dataclass(frozen=True)
class KVCapacity:
    shape: KVShape
    dtype: str
    block_size: int
    num_blocks: int  # per attention worker
    max_num_batched_tokens: int

    @property
    def bytes_per_block(self) -> int:
        """The engine's ``KVCache.bytes_per_block`` (fp8: with the scales)."""
        m = self.shape
        return KVCache.bytes_per_block(m.num_layers, m.num_kv_heads, m.head_dim, self.block_size,
                                       KV_DTYPES[self.dtype], m.latent_dim)

    @property
    def scale_bytes_per_token(self) -> float:
        """fp8: the scales' share of ``bytes_per_token`` (0 otherwise)."""
        m = self.shape
        data = KVCache.bytes_per_block(m.num_layers, m.num_kv_heads, m.head_dim, self.block_size, torch.uint8,
                                       m.latent_dim)
        return (self.bytes_per_block - data) / self.block_size if self.dtype == "fp8_e4m3" else 0.0

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    @property
    def tokens_per_worker(self) -> int:
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks one sequence of ``tokens`` tokens holds at most (``KVCache.sequence_blocks``)."""
        return KVCache.sequence_blocks(tokens, self.block_size, self.shape.window, self.max_num_batched_tokens)

    def cp_ranks(self, tokens: int) -> int:
        """Attention workers whose caches together hold one prompt of ``tokens`` tokens (its KV
        split evenly over the ranks, as context parallelism shards it)."""
        return max(1, math.ceil(self.blocks_for(tokens) / max(self.num_blocks, 1)))


def kv_capacity(model: ModelConfig | ModelSpec | KVShape, dtype: str, block_size: int = 16,
                kv_cache_gb: float | None = 1.0, num_kv_blocks: int | None = None,
                max_num_batched_tokens: int = 2048) -> KVCapacity:
    """The capacity of one attention worker's cache for ``model`` stored in ``dtype`` (its blocks as
    ``engine.builder.kv_blocks`` counts them)."""
    if dtype not in KV_DTYPES:
        raise ConfigError(f"unknown KV cache dtype {dtype!r}; use {', '.join(KV_DTYPES)}")
    if block_size < 1 or (num_kv_blocks is None and not (kv_cache_gb and kv_cache_gb > 0)):
        raise ConfigError("block_size must be >= 1, and the cache needs kv_cache_gb > 0 or num_kv_blocks >= 1")
    shape = model if isinstance(model, KVShape) else KVShape.of(model)
    cap = KVCapacity(shape, dtype, block_size, 0, max_num_batched_tokens)
    blocks = num_kv_blocks if num_kv_blocks is not None else int(kv_cache_gb * 2**30 // cap.bytes_per_block)
    return replace(cap, num_blocks=blocks)


def capacity_table(caps: list[KVCapacity], prompts: list[int]) -> str:
    """The report (``caps``: one model in several dtypes): per dtype, bytes per token and tokens per
    worker; per prompt length, the blocks one sequence holds and the CP ranks it needs in each dtype."""
    c0 = caps[0]
    cfg = c0.shape
    layout = (f"MLA latent of {cfg.latent_dim}" if cfg.latent_dim
              else f"K and V of {cfg.num_kv_heads} heads x {cfg.head_dim}")
    lines = [f"KV cache of {cfg.name}: {cfg.num_layers} layers, {layout} per token and layer; "
             f"blocks of {c0.block_size} tokens"
             + (f"; every layer windowed to {cfg.window} tokens" if cfg.window else "")]
    lines.append(f"{'KV dtype':<12} {'bytes/token':>12} {'bytes/block':>12} {'blocks/worker':>14} {'tokens/worker':>14}")
    for c in caps:
        mark = "*" if c.dtype == "fp8_e4m3" else ""
        lines.append(f"{c.dtype + mark:<12} {c.bytes_per_token:>12,.1f} {c.bytes_per_block:>12,} {c.num_blocks:>14,} "
                     f"{c.tokens_per_worker:>14,}")
    if prompts:
        lines.append("")
        lines.append(f"{'prompt tokens':>13} {'blocks':>8} " + " ".join(f"{'CP ranks ' + c.dtype:>18}" for c in caps))
        for n in prompts:
            lines.append(f"{n:>13,} {c0.blocks_for(n):>8,} " + " ".join(f"{c.cp_ranks(n):>18}" for c in caps))
    for c in caps:
        if c.dtype == "fp8_e4m3":
            lines.append(f"* --kv-cache-dtype fp8_e4m3: one byte per element and a float32 scale per block and "
                         f"{'block (MLA latent)' if cfg.latent_dim else 'KV head'}: {c.scale_bytes_per_token:,.2f} "
                         f"of the {c.bytes_per_token:,.2f} bytes per token are scales")
            break
    return "\n".join(lines)
