"""Decode over sharded KV: a sequence whose prompt was prefilled context parallel with its KV kept
where each rank computed it (``afdserve.engine.cp``). The owner computes the step's query, writes
its new KV, sends the query to the ranks holding the other shards (``ShardedContext.peers``),
attends over its own keys (its pieces and the tokens it decoded since) meanwhile, and merges the
partials by their log-sum-exps (``afdserve.backends.pytorch.ring.merge``, with gpt-oss's sinks
once). A helper rank computes the partial of a query over its shard (``shard_partial``).

Functions over a bound layer's modules, like ``afdserve.backends.pytorch.cp_half``:
``sharded_attention`` (an ``AttentionPart``: GQA, q/k norms, windows, sinks, biases) and
``sharded_latent`` (an ``MLAPart``: the absorbed form, its queries ``[q_nope W_UK | q_pe]`` sent to
the helpers, ``W_UV`` applied to the merged latent output). Keys are read through the cache's
access (``afdserve.backends.pytorch.kv``: plain, or FP8 dequantized); visibility is by position
(``afdserve.backends.pytorch.ring``), so a window that ends before a shard leaves it out.
"""

from __future__ import annotations

import torch

from afdserve.backends.pytorch.kv import kv_access
from afdserve.backends.pytorch.ring import RingAttention, merge
from afdserve.backends.step import ShardedContext
from afdserve.kvcache.fp8 import Fp8Pages

PORTABLE = RingAttention(fused_cpu=False)  # the partial attentions of a context that names none


def sharded_attention(layer, index: int, x: torch.Tensor, ctx: ShardedContext, k_cache, v_cache
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The attention half of ``layer`` (an ``AttentionPart``), layer number ``index``, for the new
    token x [1, H] of a sharded sequence: (h, y, the bound router's float32 logits of y or None)."""
    a, t = layer, x.shape[0]
    qkv = a.qkv(a.input_norm(x))
    k = qkv.new_empty(t, a.num_kv_heads, a.head_dim)
    v = qkv.new_empty(t, a.num_kv_heads, a.head_dim)
    norms = (None, None) if a.q_norm is None else (a.q_norm.weight, a.k_norm.weight)
    q = a.input_norm.ops.rope_cache(qkv, ctx.cos, ctx.sin, k, v, torch.arange(t, device=x.device), a.num_heads,
                                    a.num_kv_heads, *norms, a.eps)
    ctx.peers.ask(index, q, ctx.positions)
    kv = kv_access(isinstance(k_cache, Fp8Pages))
    kv.write(k_cache, ctx, k)
    kv.write(v_cache, ctx, v)
    keys, vals = kv.gather(k_cache, ctx.own_slots, x.dtype), kv.gather(v_cache, ctx.own_slots, x.dtype)
    att = ctx.attention or PORTABLE
    parts = [att.partial(q, keys, vals, ctx.positions, ctx.own_positions, a.scale, a.window, _mode(a.window))]
    out = merge(parts + ctx.peers.answers(index), a.sinks, x.dtype)
    h, y = a.post_norm.add_forward(a.o_proj(out.reshape(t, -1)), x)
    router = getattr(a.half, "router", None)
    return h, y, None if router is None else router(y).float()


def absorbed_query(layer, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """MLA's queries in the latent space: ``[q_nope W_UK | q_pe]`` [T, heads, r + rope]."""
    w_uk, _ = layer.w_kv_b()
    return torch.cat([torch.einsum("tnd,ndr->tnr", q_nope, w_uk), q_pe], dim=-1)


def sharded_latent(layer, index: int, x: torch.Tensor, ctx: ShardedContext, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention half of ``layer`` (an ``MLAPart``), layer number ``index``, for the new token x
    [1, H] of a sharded sequence: (h, y)."""
    m, nh, t = layer.mla, layer.nh, x.shape[0]
    q_nope, q_pe, latent = layer.project(x, ctx)
    q = absorbed_query(layer, q_nope, q_pe)
    ctx.peers.ask(index, q, ctx.positions)
    kv = kv_access(isinstance(cache, Fp8Pages))
    kv.write(cache, ctx, latent)
    att = ctx.attention or PORTABLE
    lat = kv.gather(cache, ctx.own_slots, x.dtype)
    parts = [att.latent_partial(q, lat, ctx.positions, ctx.own_positions, m.softmax_scale, m.kv_lora_rank)]
    merged = merge(parts + ctx.peers.answers(index), None, x.dtype)
    out = torch.einsum("tnr,nvr->tnv", merged, layer.w_kv_b()[1])
    h = x + layer.o_proj(out.reshape(t, nh * m.v_head_dim))
    return h, layer.post_norm(h)


def shard_partial(layer, caches: list, q: torch.Tensor, q_pos: torch.Tensor, slots: torch.Tensor,
                  k_pos: torch.Tensor, dtype: torch.dtype, attention: RingAttention | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A helper's part of a sharded decode step: the attention of queries ``q`` at ``q_pos`` (as
    ``sharded_attention``/``sharded_latent`` send them) over the keys of ``layer``'s ``caches``
    (keys and values, or MLA's latent alone) at ``slots``, positions ``k_pos``: (o, lse) float32."""
    kv = kv_access(isinstance(caches[0], Fp8Pages))
    att = attention or PORTABLE
    if len(caches) == 1:  # MLA's latent cache
        m = layer.mla
        return att.latent_partial(q, kv.gather(caches[0], slots, dtype), q_pos, k_pos, m.softmax_scale, m.kv_lora_rank)
    keys, vals = kv.gather(caches[0], slots, dtype), kv.gather(caches[1], slots, dtype)
    return att.partial(q, keys, vals, q_pos, k_pos, layer.scale, layer.window, _mode(layer.window))


def _mode(window: int) -> str:
    """How a decode step's queries see a shard: every key (they come after all of them), unless a
    window cuts some off (then masked by position)."""
    return "mask" if window else "full"
