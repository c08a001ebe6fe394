"""How the torch and triton attention backends write and gather the paged KV cache, chosen once when
the backends are built (``kv_access``): ``PlainKV`` for caches in the model's dtype, ``Fp8KV`` for
the FP8 cache (``afdserve.kvcache.fp8``: e4m3 with a scale per block and head, read back in the
model's dtype)."""

from __future__ import annotations

import torch

from afdserve.backends.base import NormBackend
from afdserve.backends.step import AttnContext
from afdserve.kvcache import fp8


class PlainKV:
    quantized = False

    def rope_cache(self, norm: NormBackend, qkv: torch.Tensor, ctx: AttnContext, k_cache, v_cache, layer,
                   norms: tuple) -> torch.Tensor:
        """The queries of ``qkv``, its rotated keys and values written into the caches (the norm
        backend's ``rope_cache``)."""
        return norm.rope_cache(qkv, ctx.cos, ctx.sin, k_cache, v_cache, ctx.slot_mapping, layer.num_heads,
                               layer.num_kv_heads, *norms, layer.eps)

    def write(self, cache: torch.Tensor, ctx: AttnContext, x: torch.Tensor) -> None:
        cache[ctx.slot_mapping] = x

    def gather(self, cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # cache[slots], through index_select (on the CPU several times faster than indexing)
        return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


class Fp8KV:
    quantized = True

    def rope_cache(self, norm: NormBackend, qkv: torch.Tensor, ctx: AttnContext, k_cache: fp8.Fp8Pages,
                   v_cache: fp8.Fp8Pages, layer, norms: tuple) -> torch.Tensor:
        """As ``PlainKV.rope_cache``, the keys and values rotated into a step buffer by the norm
        backend, then quantized into the cache."""
        t, d = qkv.shape[0], k_cache.shape[-1]
        k = qkv.new_empty(t, layer.num_kv_heads, d)
        v = qkv.new_empty(t, layer.num_kv_heads, d)
        rows = torch.arange(t, device=qkv.device)
        q = norm.rope_cache(qkv, ctx.cos, ctx.sin, k, v, rows, layer.num_heads, layer.num_kv_heads, *norms, layer.eps)
        self.write(k_cache, ctx, k)
        self.write(v_cache, ctx, v)
        return q

    def write(self, cache: fp8.Fp8Pages, ctx: AttnContext, x: torch.Tensor) -> None:
        fp8.write(cache, ctx.slot_mapping, x, ctx.first_rows)

    def gather(self, cache: fp8.Fp8Pages, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return fp8.dequantize(cache, slots, dtype)


def kv_access(quantized: bool) -> PlainKV | Fp8KV:
    return Fp8KV() if quantized else PlainKV()
