"""Shape functions of the kernels' ops, so that ``torch.compile`` graphs can call them."""

from __future__ import annotations

import torch


def register() -> None:
    lib = "afdserve_kernels::"

    @torch.library.register_fake(lib + "fused_moe")
    def _(x, w13, w2, b13, b2, ids, weights, local, inter, act, alpha, limit):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "linear")
    def _(x, w, bias, n, out_dtype):
        return x.new_empty(x.shape[0], n, dtype=out_dtype or x.dtype)

    @torch.library.register_fake(lib + "paged_attention")
    def _(q, k_cache, v_cache, block_tables, kv_lens, cu_q, block_size, window, scale, sinks):
        return torch.empty_like(q)

    @torch.library.register_fake(lib + "rms_norm")
    def _(x, w, eps):
        return torch.empty_like(x)

    @torch.library.register_fake(lib + "add_rms_norm")
    def _(x, residual, w, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @torch.library.register_fake(lib + "rope_cache")
    def _(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_w, k_w, eps):
        return qkv.new_empty(qkv.shape[0], heads, k_cache.shape[2])
