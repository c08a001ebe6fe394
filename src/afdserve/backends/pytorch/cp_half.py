"""The attention halves of a context-parallel (CP) prefill step: a layer's attention over one rank's
pieces of a prompt, the other ranks' keys coming through the ring (``CPContext.ring``).

Functions over a bound layer's modules, whatever backends packed its weights:

* ``cp_attention``: an ``afdserve.model.attention.AttentionPart`` (GQA, Qwen3's q/k norms, sliding
  windows, gpt-oss's sinks and biases);
* ``cp_latent``: an ``afdserve.model.mla.MLAPart`` (DeepSeek's MLA, absorbed form).

Per layer: norm, projections and RoPE (the layer's norm backend, ``input_norm.ops``, rotates into
step buffers, as ``Fp8KV.rope_cache`` does); ``ring.send`` of this rank's KV; the owner's cache
write of its own KV at ``ctx.slot_mapping``; the local partial attention (``ctx.attention``, an
``afdserve.backends.pytorch.ring.RingAttention``; the device-agnostic one where None); each received
rank's partial (the owner writes that rank's KV at ``ctx.rank_slots[rank]``); the merge
(with the sinks); output projection, residual and post-attention norm; the router's logits where the
layer's bound half computes them.

The cache is written through ``afdserve.backends.pytorch.kv``'s access for its type (``Fp8Pages``:
``Fp8KV``, quantized; a tensor: ``PlainKV``). The pieces of a CP prefill start on block boundaries
(``afdserve.kvcache.cp_split.zigzag``), so every block a write touches is entered at its first slot:
an FP8 write re-quantizes nothing held before (``first_rows`` [0]).
"""

from __future__ import annotations

import dataclasses

import torch

from afdserve.backends.pytorch.kv import kv_access
from afdserve.backends.pytorch.ring import RingAttention, merge
from afdserve.backends.step import CPContext
from afdserve.kvcache.fp8 import Fp8Pages

PORTABLE = RingAttention(fused_cpu=False)  # the partial attentions of a context that names none


def cp_attention(layer, index: int, x: torch.Tensor, ctx: CPContext, k_cache, v_cache
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The attention half of ``layer`` (an ``AttentionPart`` bound to its backends), layer number
    ``index`` of the model (the ring's tag), for this rank's tokens x [T, H] of a CP prefill:
    (h, y, the float32 router logits of y or None), as ``AttentionHalf`` returns them. The logits
    are those of the router the layer's half was bound with (``layer.half.router``, a plain one);
    None where it has none: the caller routes y itself. ``k_cache``/``v_cache``: the layer's caches
    (written by the owner only)."""
    a, t = layer, x.shape[0]
    qkv = a.qkv(a.input_norm(x))
    k = qkv.new_empty(t, a.num_kv_heads, a.head_dim)
    v = qkv.new_empty(t, a.num_kv_heads, a.head_dim)
    rows = torch.arange(t, device=x.device)
    norms = (None, None) if a.q_norm is None else (a.q_norm.weight, a.k_norm.weight)
    q = a.input_norm.ops.rope_cache(qkv, ctx.cos, ctx.sin, k, v, rows, a.num_heads, a.num_kv_heads, *norms, a.eps)
    ring, att = ctx.ring, ctx.attention or PORTABLE
    ring.send(index, [k, v], ctx.positions)
    writer = _Writer(ctx, [k_cache, v_cache])
    writer.own([k, v])
    own = ctx.pieces_of(ctx.rank)
    parts = [att.attend(q, k, v, ctx.positions, ctx.positions, own, own, a.scale, a.window)]
    for rank, (rk, rv), pos in ring.receive(index):
        writer.received(rank, [rk, rv])
        parts.append(att.attend(q, rk, rv, ctx.positions, pos, own, ctx.pieces_of(rank), a.scale, a.window))
    out = merge(parts, a.sinks, x.dtype)
    h, y = a.post_norm.add_forward(a.o_proj(out.reshape(t, -1)), x)
    router = getattr(a.half, "router", None)
    return h, y, None if router is None else router(y).float()


def cp_latent(layer, index: int, x: torch.Tensor, ctx: CPContext, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention half of ``layer`` (an ``MLAPart``), layer number ``index``, for this rank's tokens
    x [T, H] of a CP prefill: (h, y) as ``MLAPart.forward``. Queries and latents are the layer's
    (``project``); the attention is the absorbed form over every rank's latents, ``W_UV`` applied
    to the merged latent output. ``cache``: the layer's latent cache (written by the owner only)."""
    m, nh, t = layer.mla, layer.nh, x.shape[0]
    q_nope, q_pe, latent = layer.project(x, ctx)
    ring, attention = ctx.ring, ctx.attention or PORTABLE
    ring.send(index, [latent], ctx.positions)
    writer = _Writer(ctx, [cache])
    writer.own([latent])
    w_uk, w_uv = layer.w_kv_b()
    q = torch.cat([torch.einsum("tnd,ndr->tnr", q_nope, w_uk), q_pe], dim=-1)  # [T, nh, r + rope]
    r, scale = m.kv_lora_rank, m.softmax_scale
    own = ctx.pieces_of(ctx.rank)
    parts = [attention.latent_partial(q, latent, ctx.positions, ctx.positions, scale, r, own, own)]
    for rank, (lat,), pos in ring.receive(index):
        writer.received(rank, [lat])
        parts.append(attention.latent_partial(q, lat, ctx.positions, pos, scale, r, own, ctx.pieces_of(rank)))
    out = torch.einsum("tnr,nvr->tnv", merge(parts, None, x.dtype), w_uv)
    h = x + layer.o_proj(out.reshape(t, nh * m.v_head_dim))
    return h, layer.post_norm(h)


class _Writer:
    """The owner's cache writes of one layer (a helper rank's: none): its own KV at the step's slots,
    each received rank's at ``ctx.rank_slots[rank]``; with ``ctx.keep``, every rank's own KV only."""

    def __init__(self, ctx: CPContext, caches: list):
        self.ctx, self.caches = ctx, caches
        self.kv = kv_access(isinstance(caches[0], Fp8Pages))

    def own(self, parts: list[torch.Tensor]) -> None:
        if self.ctx.owner or self.ctx.keep:
            for cache, x in zip(self.caches, parts, strict=True):
                self.kv.write(cache, self.ctx, x)

    def received(self, rank: int, parts: list[torch.Tensor]) -> None:
        if not self.ctx.owner or self.ctx.keep or parts[0].shape[0] == 0:
            return
        slots = self.ctx.rank_slots[rank]
        if slots.shape[0] != parts[0].shape[0]:
            raise ValueError(f"CP step: rank {rank} sent {parts[0].shape[0]} tokens, the owner has "
                             f"{slots.shape[0]} slots for it")
        at = dataclasses.replace(self.ctx, slot_mapping=slots, first_rows=slots.new_zeros(1))
        for cache, x in zip(self.caches, parts, strict=True):
            self.kv.write(cache, at, x)
