"""Shape functions of the kernels' ops, so that ``torch.compile`` graphs can call them."""

from __future__ import annotations

import torch


def register() -> None:
    """Registers the shape function of every op this build defines (a build for a CPU without
    AVX-512 defines only some: ``supported`` says which run)."""
    lib = "afdserve_kernels::"
    ns = torch.ops.afdserve_kernels

    def fake(name: str):
        if hasattr(ns, name):
            return torch.library.register_fake(lib + name)
        return lambda fn: fn

    @fake("fused_moe")
    def _(x, w13, w2, b13, b2, ids, weights, local, inter, act, alpha, limit, counts=None):
        return torch.empty_like(x)

    @fake("linear")
    def _(x, w, bias, n, out_dtype, stream=False):
        return x.new_empty(x.shape[0], n, dtype=out_dtype or x.dtype)

    @fake("paged_attention")
    def _(q, k_cache, v_cache, block_tables, kv_lens, cu_q, block_size, window, scale, sinks):
        return torch.empty_like(q)

    @fake("rms_norm")
    def _(x, w, eps):
        return torch.empty_like(x)

    @fake("add_rms_norm")
    def _(x, residual, w, eps):
        return torch.empty_like(x), torch.empty_like(x)

    @fake("rope_cache")
    def _(qkv, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_w, k_w, eps):
        return qkv.new_empty(qkv.shape[0], heads, k_cache.shape[2])

    @fake("attention_half")
    def _(x, in_w, qkv_w, qkv_b, cos, sin, k_cache, v_cache, slots, heads, kv_heads, q_w, k_w, block_tables, kv_lens,
          cu_q, block_size, window, scale, sinks, o_w, o_b, post_w, router_w, experts, eps):
        logits = x.new_empty(x.shape[0], experts, dtype=torch.float32) if router_w is not None \
            else x.new_empty(0, dtype=torch.float32)
        return torch.empty_like(x), torch.empty_like(x), logits
